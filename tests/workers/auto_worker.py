"""Run under torchrun: each model trains 2 steps with ``CuboidStrategy(layout="auto")``; the second step's peak
bytes per rank are measured with torch's MemTracker (every tensor alive: parameters, gradients, optimizer state,
activations, temporaries, FSDP's gathered copies) and written beside what the planner predicted for the layout it
chose. ``python auto_worker.py OUT.json MODEL...`` (models: llama, vlm, dense, lstm)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuboid import CuboidStrategy, compat  # noqa: E402
from cuboid.models import CausalLM  # noqa: E402

warnings.filterwarnings("ignore")


class Llama(CausalLM):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randint(0, 256, (64, 129), generator=torch.Generator().manual_seed(0))),
                          batch_size=8)  # fmt: skip

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        return super().training_step(batch[0], batch_idx)


class Dense(L.LightningModule):
    """A plain multilayer perceptron on feature vectors (no blocks container: one module list of Linear+ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[override]
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)),
                          batch_size=32)  # fmt: skip


class LSTM(L.LightningModule):
    """A two-layer LSTM tagger on token sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 500)

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        (tokens,) = batch
        out, _ = self.lstm(self.embed(tokens[:, :-1]))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):  # type: ignore[override]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 500, (128, 65), generator=g)), batch_size=16)


def vlm() -> L.LightningModule:
    import third_party

    class VLM(third_party.HFModule):
        def train_dataloader(self) -> DataLoader:
            data: Dataset = third_party.dataset("hf_llava", n=32)
            return DataLoader(data, batch_size=4)

    return VLM("hf_llava")


MODELS = {"llama": lambda: Llama("debug"), "dense": Dense, "lstm": LSTM, "vlm": vlm}


class Peak(L.Callback):
    """The second training step's peak bytes on this rank (torch's MemTracker around the whole step)."""

    def __init__(self) -> None:
        self.peak = 0
        self._cm = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx == 1:
            self._cm = compat.track_memory(pl_module, trainer.optimizers[0])
            self._mem = self._cm.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self._cm is not None:
            self.peak = self._mem.peak()["Total"]
            self._cm.__exit__(None, None, None)
            self._cm = None


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    results = {}
    for name in names:
        torch.manual_seed(0)
        peak = Peak()
        strategy = CuboidStrategy(layout="auto")
        trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[peak])  # fmt: skip
        trainer.fit(MODELS[name]())
        peaks = [0] * dist.get_world_size()
        dist.all_gather_object(peaks, peak.peak)
        predicted = sum((strategy.layout_prediction or {}).values())
        results[name] = {"layout": strategy.layout.describe(), "predicted": predicted, "measured": max(peaks),
                         "per_rank": peaks, "parts": strategy.layout_prediction}  # fmt: skip
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
