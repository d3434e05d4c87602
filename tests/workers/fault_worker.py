"""Runs that would hang without Cuboid's fault handling: a stuck rank, uneven batch counts.

    torchrun --nproc-per-node N fault_worker.py OUT_DIR SCENARIO

SCENARIO (N):
  hang (4)            dp2 x tp2 reference Llama, timeout 4 s: rank 1 sleeps in training_step at step 3 (stuck in user
                      code, alive: its heartbeats go on), so its peers wait in their collectives.
  uneven_train (2)    dp2, loaders without Lightning's sampler: rank 0 has 6 batches, rank 1 has 5.
  uneven_val (2)      dp2, even training, validation 3 batches on rank 0 and 4 on rank 1.
  iterable (2)        dp2, IterableDatasets: training 5 batches on rank 0 and 7 on rank 1 (2 epochs); validation 3
                      and 2 batches.
  peers_by_rank (4)   dp2 x tp2 reference Llama, a token stream the module deals over every rank by hand
                      (``torch.distributed.get_rank()``), as users shard an IterableDataset.
  peers_by_dp (2)     tp2, the same stream dealt over ``trainer.strategy.distributed_sampler_kwargs``: 3 steps.
  crops (4)           dp2 x tp2 reference Llama, ``seed_everything(workers=True)``, each sample a random roll drawn in
                      a DataLoader worker (2 workers), and a number drawn from the main process's generator in each
                      training step: 3 steps.

Each rank that returns writes OUT_DIR/rank<r>.json: the exception (type, text with notes) or None, the global step,
and the batches each step hook saw (for the streams: the sample ids of each training batch).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity_lib import GLOBAL_BATCH, SEED, LlamaModule, TokenDataset  # noqa: E402

from cuboid import CuboidStrategy  # noqa: E402


class StuckRank(LlamaModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def training_step(self, batch, batch_idx):
        if self.global_step == 3 and self.global_rank == 1:
            (self.out / "stall.json").write_text(json.dumps({"time": time.time()}))
            time.sleep(120)  # stuck in user code: a deadlocked loader, a debugger, a slow file system
        return super().training_step(batch, batch_idx)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.seen: dict[str, int] = {"train": 0, "val": 0}

    def training_step(self, batch, batch_idx):
        self.seen["train"] += 1
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.seen["val"] += 1
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class Stream(IterableDataset):
    """``n`` batches of 4 samples, no length (a sharded stream)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.n)
        for _ in range(self.n):
            yield torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


class DealtStream(IterableDataset):
    """Token windows dealt over ``world`` ranks by hand, as users shard a stream: this rank takes every world-th."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.data = rank, world, TokenDataset(n=96)

    def __iter__(self):
        for i in range(self.rank, len(self.data), self.world):
            yield self.data[i]


class RandomRolls(TokenDataset):
    """Each sample rolled by a random offset drawn when it is read (a random crop of a longer document)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        shift = torch.randint(0, len(item["tokens"]), ())
        return {**item, "tokens": item["tokens"].roll(int(shift)), "shift": shift}


class RolledLlama(LlamaModule):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list] = {"shifts": [], "drawn": []}

    def training_step(self, batch, batch_idx):
        self.seen["shifts"].append(batch["shift"].tolist())
        self.seen["drawn"].append(torch.rand(()).item())  # what a step's own randomness (a noise, a mask) draws
        return super().training_step(batch, batch_idx)


class StreamedLlama(LlamaModule):
    """Its own ``train_dataloader``, made once the processes exist; ``by``: how it deals the stream."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.by, self.seen = by, {"ids": []}

    def train_dataloader(self):
        if self.by == "rank":  # every rank its own share: what the check must stop
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:  # the data-parallel ranks, as the error says
            dealt = self.trainer.strategy.distributed_sampler_kwargs
            rank, world = dealt["rank"], dealt["num_replicas"]
        return DataLoader(DealtStream(rank, world), batch_size=GLOBAL_BATCH // world)

    def training_step(self, batch, batch_idx):
        self.seen["ids"].append(batch["idx"].tolist())
        return super().training_step(batch, batch_idx)


def tensors(batches: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(4 * batches, 8, generator=g), torch.randn(4 * batches, 1, generator=g))


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    L.seed_everything(SEED, verbose=False, workers=scenario == "crops")
    rank = int(__import__("os").environ["RANK"])
    common = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir=str(out))  # fmt: skip
    module: L.LightningModule
    if scenario == "hang":
        strategy = CuboidStrategy(data_parallel_shard=2, tensor_parallel=2, timeout=4)
        trainer = L.Trainer(devices=4, strategy=strategy, max_steps=6, **common)
        module = StuckRank(out)
        train, val = DataLoader(TokenDataset(n=96), batch_size=GLOBAL_BATCH // 2), None
    elif scenario in ("uneven_train", "uneven_val"):
        trainer = L.Trainer(devices=2, strategy=CuboidStrategy(data_parallel_shard="auto", timeout=20), max_epochs=1,
                            use_distributed_sampler=False, **common)  # fmt: skip
        module = Regressor()
        n_train = (6 if rank == 0 else 5) if scenario == "uneven_train" else 6
        train = DataLoader(tensors(n_train), batch_size=4)
        val = DataLoader(tensors(3 if rank == 0 else 4), batch_size=4) if scenario == "uneven_val" else None
    elif scenario == "iterable":
        trainer = L.Trainer(devices=2, strategy=CuboidStrategy(data_parallel_shard="auto", timeout=20), max_epochs=2, num_sanity_val_steps=0,
                            **common)  # fmt: skip
        module = Regressor()
        train = DataLoader(Stream(5 if rank == 0 else 7), batch_size=None)
        val = DataLoader(Stream(3 if rank == 0 else 2), batch_size=None)
    elif scenario in ("peers_by_rank", "peers_by_dp"):
        dp = 2 if scenario == "peers_by_rank" else 1
        strategy = CuboidStrategy(data_parallel_shard=dp, tensor_parallel=2, timeout=20)
        trainer = L.Trainer(devices=2 * dp, strategy=strategy, max_steps=3, **common)
        module, train, val = StreamedLlama(scenario.removeprefix("peers_by_")), None, None
    elif scenario == "crops":
        strategy = CuboidStrategy(data_parallel_shard=2, tensor_parallel=2, timeout=20)
        trainer = L.Trainer(devices=4, strategy=strategy, max_steps=3, **common)
        module, val = RolledLlama(), None
        train = DataLoader(RandomRolls(n=96), batch_size=GLOBAL_BATCH // 2, shuffle=True, num_workers=2)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    facts: dict = {"exception": None}
    try:
        trainer.fit(module, train, val)
    except Exception as err:  # noqa: BLE001  (what the test checks)
        facts["exception"] = type(err).__name__
        facts["message"] = "".join(traceback.format_exception_only(err))
    facts.update(global_step=trainer.global_step, seen=getattr(module, "seen", None), time=time.time())
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    if facts["exception"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
