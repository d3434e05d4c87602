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


class Reads(Dense):
    """A step that reads a value of what it computed (``loss.item()``): fake tensors have none to give."""

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:
            raise RuntimeError("diverged")
        return loss


MODELS = {
    "llama": lambda: Llama("debug"),
    "moe": lambda: Llama("moe_debug"),
    "dense": Dense,
    "lstm": LSTM,
    "vlm": vlm,
    "reads": Reads,
}
# spec -> (model, the strategy's arguments beside layout="auto", whether an explicit run of the choice follows)
SPECS = {
    "dense": ("dense", {}, False), "lstm": ("lstm", {}, False), "llama": ("llama", {}, False), "vlm": ("vlm", {}, False),
    "reads": ("reads", {}, False), "moe": ("moe", {}, False),
    "llama_tp2": ("llama", {"tensor_parallel": 2}, True),
    "llama_pp2": ("llama", {"pipeline_parallel": 2}, True),
    "llama_tight": ("llama", {"device_memory": 16e6}, True),  # below what dp_shard needs without AC
    "llama_ac": ("llama", {"activation_checkpointing": "full"}, True),
}  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class Peak(L.Callback):
    """The second training step's peak bytes on this rank, two ways: torch's MemTracker around the whole step (not
    under pp, where a stage's forward runs once per micro-batch, which MemTracker refuses), and ``compat.LiveBytes``
    following FSDP2's resized storages, started from this rank's parameter shards, gradients and optimizer state;
    and each step's loss where this rank has it."""

    def __init__(self) -> None:
        self.peak = self.live_peak = 0
        self._cm: object = None
        self._live: object = None
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step != 1:  # the second step (an epoch may hold one batch per rank)
            return
        optimizer = trainer.optimizers[0]
        held = [_local(p) for p in pl_module.parameters()] + [_local(p.grad) for p in pl_module.parameters()
                                                               if p.grad is not None]  # fmt: skip
        held += [_local(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        held = list({id(t.untyped_storage()): t for t in held}.values())
        start = sum(t.untyped_storage().nbytes() for t in held)
        self._live = compat.LiveBytes(start, held, follow_resize=True)
        self._live.__enter__()
        if trainer.strategy.layout.pp == 1:
            self._cm = compat.track_memory(pl_module, optimizer)
            self._mem = self._cm.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach()))
        if self._cm is not None:
            self.peak = self._mem.peak()["Total"]
            self._cm.__exit__(None, None, None)
            self._cm = None
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self.live_peak = self._live.peak
            self._live = None


def fit(model: str, strategy: CuboidStrategy, steps: int = 2) -> Peak:
    torch.manual_seed(0)
    peak = Peak()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[peak])  # fmt: skip
    trainer.fit(MODELS[model]())
    return peak


def gathered(value: object) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    results = {}
    for name in names:
        model, given, twin = SPECS[name]
        strategy = CuboidStrategy(layout="auto", **given)
        peak = fit(model, strategy, steps=3 if twin else 2)
        chosen = {**(strategy.layout_choice or {})}
        results[name] = {"layout": strategy.layout.describe(), "predicted": (strategy.layout_prediction or {}).get("peak", 0),
                         "measured": max(gathered(peak.peak or peak.live_peak)), "per_rank": gathered(peak.peak),
                         "live": max(gathered(peak.live_peak)), "tracker": "MemTracker" if peak.peak else "LiveBytes",
                         "parts": strategy.layout_prediction, "chosen": chosen, "losses": gathered(peak.losses)}  # fmt: skip
        if twin and chosen:  # the same layout asked for by name: the run auto made must be that run
            explicit = fit(model, CuboidStrategy(**chosen), steps=3)
            results[name]["explicit_losses"] = gathered(explicit.losses)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
