"""The ranks of one data-parallel rank read the same batch, or the run stops before it trains on a mix.

Under Cuboid only the data-parallel ranks split the data. The tensor-, context- and pipeline-parallel ranks of one
data-parallel rank (its *peers*) compute one step of one model replica together, so each must be given the same
batch: Lightning's sampler is dealt over the data-parallel ranks (``trainer.strategy.distributed_sampler_kwargs``).
A loader that deals over every rank instead gives peers different inputs, and the step trains on a mix of them
with no error: an ``IterableDataset`` sharded by ``torch.distributed.get_rank()`` or ``trainer.global_rank``,
``datasets.distributed.split_dataset_by_node(..., rank=trainer.global_rank)``, a sampler of one's own, random
augmentation seeded by the global rank.

:class:`PeerBatches` (added to the Trainer's callbacks by the strategy at setup, every stage) fingerprints the first
batch of each training epoch and the first batch of each evaluation loader on every rank: one copy of that batch to
the host and one small all-gather over the host group, none in the steps after. When peers' batches differ, every
rank stops with :class:`PeerBatchesDiffer` before that batch's step, naming the ranks and the fix. With no tp, cp or
pp (each rank its own data-parallel rank) it does nothing.

``cuboid.compat.seed_workers_by_data_rank`` (the strategies' ``process_dataloader``) makes Lightning's seeding of
DataLoader workers (``seed_everything(workers=True)``), which mixes in the global rank, mix in the data-parallel
rank instead, so that random crops and augmentations drawn in workers agree on peers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.distributed as dist


class PeerBatchesDiffer(RuntimeError):
    """Ranks that must read the same batch (the tp, cp and pp ranks of one data-parallel rank) were given different
    ones."""


def fingerprint(batch: Any) -> str:
    """A digest of a batch's contents: every tensor's dtype, shape and bytes, and the plain values (strings,
    numbers) around them, in order. Other objects count by their type only (their ``repr`` may hold an address).
    The tensors' bytes are joined on their device and copied to the host once per device (one sync on a GPU, not
    one per tensor)."""
    digest = hashlib.blake2b(digest_size=8)
    contents: dict[torch.device, list[torch.Tensor]] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach()
            digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.layout == torch.strided and not t.is_nested and t.numel():
                contents.setdefault(t.device, []).append(t.reshape(-1).contiguous().view(torch.uint8))
        elif isinstance(value, Mapping):
            digest.update(f"M{len(value)}".encode())
            for key in sorted(value, key=repr):
                digest.update(repr(key).encode())
                visit(value[key])
        elif isinstance(value, (list, tuple)):
            digest.update(f"L{len(value)}".encode())
            for item in value:
                visit(item)
        elif value is None or isinstance(value, (str, bytes, int, float, bool)):
            digest.update(repr(value).encode())
        else:
            digest.update(f"O{type(value).__qualname__}".encode())

    visit(batch)
    for _, parts in sorted(contents.items(), key=lambda item: str(item[0])):
        digest.update(f"D{len(parts)}".encode())
        digest.update(torch.cat(parts).cpu().numpy().tobytes())
    return digest.hexdigest()


class PeerBatches(L.Callback):
    """Compares the first batch of each loop over each data-parallel rank's peers (see the module's docstring)."""

    def __init__(self, trainer: Any, group: Any, data_rank: int, data_ranks: int, dealt_over: int) -> None:
        """``data_rank``: this rank's sampler rank (its peers share it); ``data_ranks``: how many of them ``group``
        holds; ``dealt_over``: how many the sampler deals over in the whole job (more than ``data_ranks`` with
        replica groups), which the error message names."""
        self.trainer, self.group = trainer, group
        self.data_rank = data_rank  # the sampler's rank: peers share it
        self.dealt_over = dealt_over
        self.active = dist.is_initialized() and dist.get_world_size(group) > data_ranks
        self._pending: set[tuple[str, int]] = set()  # (stage, loader) whose first batch is still to be compared

    def install(self) -> None:
        if self.active and self not in self.trainer.callbacks:
            self.trainer.callbacks.append(self)

    def uninstall(self) -> None:
        if self in self.trainer.callbacks:
            self.trainer.callbacks.remove(self)

    # --- the start of a loop: its first batch (of each loader) is compared
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending.add(("training", 0))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending |= {("validation", i) for i in range(len(trainer.num_val_batches))}

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending |= {("test", i) for i in range(len(trainer.num_test_batches))}

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending |= {("predict", i) for i in range(len(trainer.num_predict_batches))}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._compare("training", 0, batch, trainer)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int, loader: int = 0):
        self._compare("validation", loader, batch, trainer)

    def on_test_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int, loader: int = 0):
        self._compare("test", loader, batch, trainer)

    def on_predict_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int, loader: int = 0):
        self._compare("predict", loader, batch, trainer)

    def _compare(self, stage: str, loader: int, batch: Any, trainer: L.Trainer) -> None:
        if (stage, loader) not in self._pending:
            return
        self._pending.discard((stage, loader))
        rows: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(rows, (self.data_rank, fingerprint(batch)), group=self.group)
        differ = _differing(rows)
        if differ:
            where = f"{stage} (loader {loader})" if loader else stage
            raise PeerBatchesDiffer(_message(where, trainer.current_epoch, differ, self.dealt_over))


def _differing(rows: list[tuple[int, str]]) -> dict[int, list[tuple[int, str]]]:
    """The data-parallel ranks whose peers hold different batches: dp rank -> [(global rank, digest)]."""
    peers: dict[int, list[tuple[int, str]]] = {}
    for rank, (data_rank, digest) in enumerate(rows):
        peers.setdefault(data_rank, []).append((rank, digest))
    return {d: ranks for d, ranks in sorted(peers.items()) if len({digest for _, digest in ranks}) > 1}


def _message(where: str, epoch: int, differ: dict[int, list[tuple[int, str]]], data_ranks: int) -> str:
    shown = []
    for data_rank, ranks in list(differ.items())[:4]:
        groups: dict[str, list[int]] = {}
        for rank, digest in ranks:
            groups.setdefault(digest, []).append(rank)
        split = " / ".join("ranks " + ", ".join(map(str, rs)) if len(rs) > 1 else f"rank {rs[0]}" for rs in
                           groups.values())  # fmt: skip
        shown.append(f"data-parallel rank {data_rank}: {split}")
    more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
    return (
        f"{where}, epoch {epoch}: ranks that must read the same batch were given different ones "
        f"({'; '.join(shown)}{more}). The tensor-, context- and pipeline-parallel ranks of one data-parallel rank "
        "compute one step together; with different inputs they would train on a mix of them. Deal your data over "
        f"the {data_ranks} data-parallel ranks only: `trainer.strategy.distributed_sampler_kwargs` gives this rank's "
        "`num_replicas` and `rank` (for an IterableDataset, a sampler of your own, or "
        "`datasets.distributed.split_dataset_by_node`), not `torch.distributed.get_rank()`, `trainer.global_rank` "
        "or `trainer.world_size`; and seed any random augmentation the same on those ranks."
    )
