"""Every rank runs the same number of batches, or the run stops at once with the counts; it never hangs.

Each training or evaluation step runs collectives (FSDP's all-gathers, tensor-parallel reductions) that pair up
across ranks, so a rank with one batch more than another waits in its extra step forever. Lightning's
``DistributedSampler`` pads every rank to the same count, but a user's own sampler, a ``use_distributed_sampler=False``
loader or a sharded ``IterableDataset`` need not. :class:`EvenBatches` (added to the Trainer's callbacks by the
strategy at setup, every stage) checks:

* **Sized loaders** (``len()`` known): at the start of each training epoch, and of each validation, test or
  predict run, the per-rank counts (after ``limit_*_batches``) are gathered over the host group (one small gloo
  all-gather, never per step). Counts that differ stop every rank together with :class:`UnevenBatchesError`, the
  counts per rank and the fixes, before any step runs.
* **Loaders without a length** (an ``IterableDataset``): before each batch every rank says whether its loader is
  on its last batch (Lightning's fetcher looks one batch ahead); when any rank is, that batch is the last on every
  rank: the epoch (or the evaluation) ends there together, with one warning naming the rank that ran out. One host
  all-reduce per batch, only for such loaders.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from cuboid import compat

_MAX_LOADERS = 16


class UnevenBatchesError(RuntimeError):
    """Ranks would run different numbers of batches (each step's collectives pair up across ranks)."""


class EvenBatches(L.Callback):
    def __init__(self, trainer: Any, group: Any) -> None:
        self.trainer, self.group = trainer, group
        self._unsized = False  # the current loop's loader has no length: agree before each batch
        self._ended = False  # an evaluation loop another rank finished: stop at the next batch
        self._warned: set[str] = set()

    def install(self) -> None:
        if self not in self.trainer.callbacks:
            self.trainer.callbacks.append(self)

    def uninstall(self) -> None:
        if self in self.trainer.callbacks:
            self.trainer.callbacks.remove(self)

    # --- start of a loop: compare the counts
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._unsized = self._check("training", [trainer.num_training_batches], "limit_train_batches")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start("validation", list(trainer.num_val_batches), "limit_val_batches")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start("test", list(trainer.num_test_batches), "limit_test_batches")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start("predict", list(trainer.num_predict_batches), "limit_predict_batches")

    def _start(self, stage: str, counts: list[float], limit: str) -> None:
        self._unsized, self._ended = self._check(stage, counts, limit), False

    def _check(self, stage: str, counts: list[float], limit: str) -> bool:
        """Gather this loop's batch counts; raise on every rank when they differ. Returns whether a loader is
        unsized (then the ranks agree before each batch)."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return False
        mine = [-1 if math.isinf(c) else int(c) for c in counts[:_MAX_LOADERS]]
        row = torch.full((_MAX_LOADERS + 1,), -2, dtype=torch.int64, device="cpu")  # over gloo: host memory
        row[0], row[1 : len(mine) + 1] = len(counts), torch.tensor(mine, dtype=torch.int64, device="cpu")
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, row, group=self.group)
        table = [r.tolist() for r in rows]
        if any(r != table[0] for r in table):
            raise UnevenBatchesError(_uneven_message(stage, table, limit))
        return -1 in mine

    # --- loaders without a length: agree before each batch
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self._unsized and self._any_last(compat.train_batch_is_last(trainer), trainer, "training"):
            compat.end_train_epoch_after_this_batch(trainer)

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._eval_batch(trainer, "validation")

    def on_test_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._eval_batch(trainer, "test")

    def on_predict_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._eval_batch(trainer, "predict")

    def _eval_batch(self, trainer: L.Trainer, stage: str) -> None:
        if not self._unsized:
            return
        if self._ended:  # the rank that ran out ended its loop after the previous batch: end this one too
            self._ended = False
            raise StopIteration
        self._ended = self._any_last(compat.evaluation_batch_is_last(trainer), trainer, stage)

    def _any_last(self, last: bool, trainer: L.Trainer, stage: str) -> bool:
        flags = torch.tensor([int(last), int(not last)], dtype=torch.int64, device="cpu")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        some_last, some_more = flags.tolist()
        if some_last and some_more and stage not in self._warned:
            self._warned.add(stage)
            rank_zero_warn(
                f"Cuboid: {stage}: a rank's data loader (it has no length) ran out before the others'; every rank "
                "ended there together. The other ranks' remaining batches were not used: give each rank the same "
                "number of batches."
            )
        return bool(some_last) and not last


def _uneven_message(stage: str, table: list[list[int]], limit: str) -> str:
    def counts(row: list[int]) -> str:
        shown = ["no length" if c == -1 else str(c) for c in row[1 : row[0] + 1]]
        return shown[0] if len(shown) == 1 else "[" + ", ".join(shown) + "]"

    per_rank = ", ".join(f"rank {r}: {counts(row)}" for r, row in enumerate(table))
    sized = [c for row in table for c in row[1 : row[0] + 1] if c >= 0]
    smallest = f" (the smallest: {min(sized)})" if sized else ""
    return (
        f"{stage}: the ranks have different numbers of batches ({per_rank}). Every rank must run the same number: "
        "each step's collectives pair up across ranks, and a rank with an extra batch would wait for the others "
        "forever. Let Lightning add its DistributedSampler (Trainer(use_distributed_sampler=True), the default; it "
        "pads every rank to the same count), give your sampler or dataset the same length on every rank, or set "
        f"Trainer({limit}=N){smallest}."
    )
