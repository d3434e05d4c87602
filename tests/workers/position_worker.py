"""Which samples each rank trains on, step by step, across a mid-epoch save and a resume on another layout.

Launched by ``harness.SpecRuns`` (``position_worker.py OUT SPECS_JSON``): each spec trains a small regressor with
``CuboidStrategy`` on a map-style dataset of 96 samples that remembers which ids it was asked for, with
Lightning's ``DistributedSampler`` (shuffled, the global seed). Rank 0 writes ``OUT/<name>.pt``: per step, the ids
every rank trained on; the ids each rank read from the dataset; the final parameters.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from cuboid import CuboidStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity_lib import LlamaModule, TokenDataset, each_spec  # noqa: E402

SAMPLES = 96


class Counting(Dataset):
    """Sample ``i`` is ``(i, x_i, y_i)``; every id asked for is recorded (what the loader read)."""

    def __init__(self, samples: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 8, generator=g)
        self.y = self.x[:, :4].sum(-1, keepdim=True).tanh()
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.read.append(int(i))
        return torch.tensor(i), self.x[i], self.y[i]


class Stream(IterableDataset):
    """A streaming source, as users write one for torchdata's ``StatefulDataLoader``: rank ``r`` of ``n`` reads ids
    ``r, r + n, ...`` of a fixed shuffled order, one at a time, and its state is how many it has handed out."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self.data = Counting(samples)
        self.order = torch.randperm(samples, generator=torch.Generator().manual_seed(1)).tolist()
        self.next, self._resume = 0, 0

    def __iter__(self):
        mine = self.order[dist.get_rank() :: dist.get_world_size()]
        self.next, self._resume = self._resume, 0
        while self.next < len(mine):
            self.next += 1
            yield self.data[mine[self.next - 1]]

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self._resume = state["next"]


class IdTokens(TokenDataset):
    """The parity suite's token sequences, each with its id; every id asked for is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[int] = []

    def __getitem__(self, i: int) -> dict:
        self.read.append(int(i))
        return {**super().__getitem__(i), "id": torch.tensor(i)}


class LlamaIds(LlamaModule):
    """The parity suite's Llama module, recording each step's batch ids on every rank (under pp the step runs per
    microbatch on the last stage only, so the ids are taken when the batch arrives)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[list[int]] = []

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self.ids.append(batch["id"].tolist())


def write_litdata(root: Path) -> None:
    """The 96 samples of :class:`Counting` as litdata's chunks (8 samples each) under ``root``, written the way a
    user's preparation step writes them (litdata's ``BinaryWriter``, in one process: under torchrun's variables its
    ``merge`` waits for every rank's part)."""
    from litdata.streaming.writer import BinaryWriter

    data, writer = Counting(), BinaryWriter(str(root), chunk_size=8)
    for i in range(SAMPLES):
        writer[i] = (i, data.x[i], data.y[i])
    writer.done()
    writer.merge()


class LitData(L.LightningDataModule):
    """litdata's ``StreamingDataLoader`` over a ``StreamingDataset`` (shuffled) of the chunks :func:`write_litdata`
    wrote at ``spec["litdata"]``, made where Lightning users make it: in ``train_dataloader``. litdata would deal the
    chunks over every rank of the process group; Cuboid hands it the data-parallel ranks when Lightning passes it the
    loader (``compat.deal_over_data_parallel``). It keeps its own state. Each item it reads is recorded in
    :attr:`read`."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec, self.read = spec, []

    def train_dataloader(self):
        import litdata.helpers
        from litdata import StreamingDataLoader, StreamingDataset

        litdata.helpers._get_newer_version = lambda version: None  # it would ask PyPI for a newer litdata: no network
        read = self.read

        class Recording(StreamingDataset):
            def __getitem__(self, index):
                item = super().__getitem__(index)
                read.append(int(item[0]))
                return item

        dataset = Recording(self.spec["litdata"], shuffle=True, seed=1)
        return StreamingDataLoader(dataset, batch_size=self.spec["batch"])


def make_loader(spec: dict):
    """The train loader a spec names: ``map`` (a DataLoader, shuffled), ``llama`` (the same over the parity
    suite's token sequences, for :class:`LlamaIds`), ``stateful`` (torchdata's
    StatefulDataLoader over the same map-style dataset), ``stream`` (a StatefulDataLoader over :class:`Stream`) or
    ``litdata`` (:class:`LitData`, a data module). Returns the loader and the dataset that records what was read."""
    kind = spec.get("loader", "map")
    if kind == "litdata":
        data = LitData(spec)
        return data, data
    if kind == "llama":
        dataset = IdTokens()
        return DataLoader(dataset, batch_size=spec["batch"], shuffle=True), dataset
    if kind == "map":
        dataset = Counting(spec.get("samples", SAMPLES))
        return DataLoader(dataset, batch_size=spec["batch"], shuffle=True), dataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    if kind == "stateful":
        dataset = Counting(spec.get("samples", SAMPLES))
        return StatefulDataLoader(dataset, batch_size=spec["batch"], shuffle=True), dataset
    stream = Stream(spec.get("samples", SAMPLES))
    return StatefulDataLoader(stream, batch_size=spec["batch"]), stream.data


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.ids: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.ids.append(ids.tolist())
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(spec: dict, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    loader, dataset = make_loader(spec)
    module = LlamaIds() if spec.get("loader") == "llama" else Regressor()
    callbacks = []
    if spec.get("save_every"):
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=out / spec["name"], every_n_train_steps=spec["save_every"], save_top_k=-1,
                filename="step={step}", auto_insert_metric_name=False,
            )
        )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=CuboidStrategy(
            timeout=timedelta(seconds=90), **{"data_parallel_shard": "auto", **spec.get("strategy", {})}
        ),
        max_steps=spec["max_steps"],
        max_epochs=spec.get("epochs", 1),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
    )
    error = None
    try:
        trainer.fit(module, loader, ckpt_path=spec.get("resume_from"))
    except Exception as err:  # noqa: BLE001  (a refusal is what some specs check)
        if not spec.get("expect_error"):
            raise
        error = f"{type(err).__name__}: {err}"
    ids: list = [None] * dist.get_world_size()
    read: list = [None] * dist.get_world_size()
    dist.all_gather_object(ids, module.ids)
    dist.all_gather_object(read, dataset.read)
    mine = {
        k: v.detach().full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
        for k, v in module.state_dict().items()
    }  # fmt: skip  (under pp, this rank's stage)
    stages: list = [None] * dist.get_world_size()
    dist.all_gather_object(stages, mine)
    params = {k: v for stage in stages for k, v in stage.items()}
    if dist.get_rank() == 0:
        torch.save({"ids": ids, "read": read, "params": params, "error": error}, out / f"{spec['name']}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    for spec in each_spec(sys.argv[2]):
        run(spec, out)


if __name__ == "__main__":
    main()
