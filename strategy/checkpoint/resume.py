"""Resuming: the newest complete checkpoint of a directory, what a checkpoint restores (so that it is not initialised
first), and where a mid-epoch resume starts.

The data position: where in an epoch's sample order a checkpoint was taken, counted over the whole data-parallel
group, so a resume on any dp degree or per-rank batch starts there without reading what it skips.

Lightning deals a map-style dataset with ``DistributedSampler``: one permutation of the epoch (seeded by
``seed + epoch``), padded to a multiple of the dp degree, rank ``r`` taking every dp-th sample from ``r``. Step
``j``'s global batch is then one contiguous range of that permutation, ``[j B, (j + 1) B)`` with ``B`` the global
batch (per-rank batch x dp). So a position is one number: the samples consumed so far in the epoch, ``C``. A
resume takes the permutation's tail from ``C`` and deals it the same way over the *current* dp ranks (padding the
tail to a multiple of dp as ``DistributedSampler`` does). With the same global batch each later step's global batch
is the uninterrupted run's; with another, every sample the epoch had not reached is seen once (and the padding, at
most dp - 1 samples, twice, as in any epoch of ``DistributedSampler``). Nothing skipped is read.

Other samplers and loaders (a ``StatefulDataLoader``, a streaming dataset, a custom sampler) keep the old way: the
epoch's trained batches are drawn and dropped at the same dp degree (``SkipFirstBatches``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from cuboid.adapters import frozen_base_names
from cuboid.checkpoint.format import META_FILE
from cuboid.checkpoint.sharded import is_sharded_checkpoint


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` (what ``ckpt_path="auto"`` resumes from), or None.

    Complete: a sharded checkpoint directory with its metadata, or a ``checkpoint_format="full"`` file; temporary
    (``.<name>.tmp``) and replaced (``.<name>.old``) ones are skipped, and a ``last`` link counts as its target.
    Newest: by the time its metadata was written.
    """
    found = checkpoints_newest_first(directory)
    return found[0] if found else None


def checkpoints_newest_first(directory: str | Path) -> list[Path]:
    """Every complete checkpoint in ``directory`` (as :func:`latest_checkpoint` counts them), newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found: dict[Path, float] = {}
    for entry in root.iterdir():
        if entry.name.startswith(".") or not entry.name.endswith(".ckpt"):
            continue
        target = entry.resolve()
        if is_sharded_checkpoint(target):
            found[target] = (target / META_FILE).stat().st_mtime
        elif target.is_file():
            found[target] = target.stat().st_mtime
    return sorted(found, key=found.__getitem__, reverse=True)


def restored_names(module: nn.Module) -> set[str]:
    """The names a checkpoint of ``module`` sets when loaded strictly: its parameters and persistent buffers, as
    ``state_dict`` names them, less a PEFT model's frozen base (an adapter's checkpoint does not store it). A
    non-persistent buffer is not among them: it is initialised even when a checkpoint comes."""
    return set(nn.Module.state_dict(module, keep_vars=True)) - frozen_base_names(module)


class _ResumingLoader:
    """What both resume wrappers of a train loader share: every other attribute is the loader's, and a state that
    Lightning saves and restores as a resumable loader's (empty: the position travels in Cuboid's own state)."""

    _loader: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SkipFirstBatches(_ResumingLoader):
    """Wraps a train DataLoader so its next epoch starts ``skip`` batches in (mid-epoch resume).

    The skipped batches are drawn and dropped, so the sampler (seeded per epoch) hands every rank the
    same samples after resume as in the uninterrupted run. Later epochs are not affected. Has
    ``state_dict``/``load_state_dict`` so Lightning treats it as resumable.
    """

    def __init__(self, loader: Any, skip: int, epoch: int) -> None:
        self._loader, self._skip, self._epoch = loader, skip, epoch

    def __iter__(self) -> Any:
        skip, self._skip = self._skip, 0
        if skip:
            # Lightning creates the iterator before it sets the sampler's epoch: set it, or a resumed
            # epoch > 0 would be shuffled like epoch 0.
            from cuboid.compat import set_sampler_epoch

            set_sampler_epoch(self._loader, self._epoch)
        iterator = iter(self._loader)
        for _ in range(skip):
            next(iterator, None)
        return iterator

    def __len__(self) -> int:
        return len(self._loader)


# --- the data position ----------------------------------------------------------------------------------------
def distributed_sampler(loader: Any) -> DistributedSampler | None:
    """The ``DistributedSampler`` a train loader draws from (Lightning's, injected), or None."""
    sampler = getattr(loader, "sampler", None)
    return sampler if type(sampler) is DistributedSampler else None


def epoch_order(sampler: DistributedSampler, epoch: int) -> list[int]:
    """The epoch's permutation, unpadded, exactly as ``DistributedSampler`` draws it."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if not sampler.shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(sampler.seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def position(samples: int, epoch: int, sampler: DistributedSampler) -> dict[str, Any]:
    """What a checkpoint stores: the epoch, the samples consumed in it over all dp ranks, and what the order
    depends on (the sampler's seed and shuffle, the dataset's length)."""
    return {"epoch": epoch, "samples": samples, "seed": sampler.seed, "shuffle": sampler.shuffle,
            "length": len(sampler.dataset)}  # type: ignore[arg-type]  # fmt: skip


def check_position(found: dict[str, Any], sampler: DistributedSampler) -> None:
    """Refuse a data position taken over another dataset or order, naming both, before any step."""
    from cuboid.checkpoint.format import CheckpointError

    now = position(0, found["epoch"], sampler)
    for key, what in (("length", "samples in the dataset"), ("seed", "sampler seed"), ("shuffle", "shuffle")):
        if found[key] != now[key]:
            raise CheckpointError(
                f"the checkpoint was taken at sample {found['samples']} of epoch {found['epoch']} with {found[key]} "
                f"{what}; this run has {now[key]}, so that position means other samples. Resume with the same "
                f"dataset and seed (seed_everything, or the main job's seed), or start from a checkpoint taken at an "
                "epoch's end. No step was run and nothing was overwritten."
            )


class TailSampler(Sampler[int]):
    """This rank's share of an epoch's permutation from position ``start``: every ``replicas``-th sample from
    ``rank``, the tail padded to a multiple of ``replicas`` as ``DistributedSampler`` pads."""

    def __init__(self, order: list[int], start: int, rank: int, replicas: int) -> None:
        tail = order[start:]
        padded = math.ceil(len(tail) / replicas) * replicas
        tail = tail + (tail * math.ceil(padded / max(len(tail), 1)))[: padded - len(tail)]
        self.indices = tail[rank::replicas]

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumedLoader(_ResumingLoader):
    """A train loader whose first epoch after a resume starts at a data position (a loader of the same dataset,
    batch size and workers over a :class:`TailSampler`); later epochs are the loader's own. Its length is the
    longer of the two, so Lightning's batch count (set once, from ``len``) never cuts an epoch short: an epoch
    ends when its iterator does."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, epoch: int, start: int, done: int) -> None:
        self._loader = loader
        order = epoch_order(sampler, epoch)
        tail = TailSampler(order, start, sampler.rank, sampler.num_replicas)
        workers = {"prefetch_factor": loader.prefetch_factor, "multiprocessing_context": loader.multiprocessing_context}
        self._first: DataLoader | None = DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=tail,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            generator=loader.generator,
            **(workers if loader.num_workers else {}),
        )  # fmt: skip
        # Lightning reads the length once, after it made the first iterator: the longer of the two epochs, kept
        self._len = max(len(loader), done + len(self._first))

    def __iter__(self) -> Any:
        first, self._first = self._first, None
        if first is not None:
            return iter(first)
        return iter(self._loader)

    def __len__(self) -> int:
        return self._len
