"""The train loaders a mid-epoch resume hands Lightning, and what a checkpoint restores (so that it is not
initialised first). Where the data stands, and which of these loaders a resume takes, is
:mod:`cuboid.checkpoint.resume.data_position`'s.

A loader Lightning deals with ``DistributedSampler`` (a map-style dataset) resumes at a data position: one
permutation of the epoch (seeded by ``seed + epoch``), padded to a multiple of the dp degree, rank ``r`` taking every
dp-th sample from ``r``. Step ``j``'s global batch is then one contiguous range of that permutation,
``[j B, (j + 1) B)`` with ``B`` the global batch (per-rank batch x dp). So a position is one number: the samples
consumed so far in the epoch, ``C``. A resume takes the permutation's tail from ``C`` and deals it the same way over
the *current* dp ranks (padding the tail to a multiple of dp as ``DistributedSampler`` does). With the same global
batch each later step's global batch is the uninterrupted run's; with another, every sample the epoch had not
reached is seen once (and the padding, at most dp - 1 samples, twice, as in any epoch of ``DistributedSampler``).
Nothing skipped is read (:class:`ResumedLoader`).

Other samplers and loaders (a ``StatefulDataLoader``, a streaming dataset, a custom sampler) keep the old way: the
epoch's trained batches are drawn and dropped at the same dp degree (:class:`SkipFirstBatches`), or the loader's own
state is kept per batch (:class:`TrackedLoader`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from cuboid.adapters import frozen_base_names


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


# --- loaders that start at a data position --------------------------------------------------------------------
def distributed_sampler(loader: Any) -> DistributedSampler | None:
    """The ``DistributedSampler`` a train loader draws from (Lightning's, injected), or None. Lightning puts it in
    the loader's ``sampler``, or, for a loader whose batch sampler is its own class (torchdata's
    ``StatefulDataLoader``), in that batch sampler's."""
    for holder in (loader, getattr(loader, "batch_sampler", None)):
        sampler = getattr(holder, "sampler", None)
        if type(sampler) is DistributedSampler:
            return sampler
    return None


def deal_as_dataloader(loader: Any) -> Any:
    """torchdata's ``StatefulDataLoader(shuffle=...)`` dealt as Lightning deals a ``DataLoader(shuffle=...)``: one
    ``DistributedSampler`` over the dataset (seeded, an order that a data position can resume on any degree).
    Lightning does not know torchdata's own ``RandomSampler``/``SequentialSampler`` and wraps them in its
    ``DistributedSamplerWrapper``, whose order comes from the global random state when the epoch starts, which no
    restored state reproduces. Any other loader is returned as it is."""
    wrapper = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if wrapper is None or type(wrapper).__name__ != "DistributedSamplerWrapper":
        return loader
    inner = getattr(wrapper.dataset, "_sampler", None)
    kind = type(inner)
    if kind.__module__ != "torchdata.stateful_dataloader.sampler" or kind.__name__ not in (
        "RandomSampler",
        "SequentialSampler",
    ):
        return loader  # fmt: skip
    from cuboid.compat import update_dataloader

    sampler = DistributedSampler(loader.dataset, num_replicas=wrapper.num_replicas, rank=wrapper.rank,
                                 shuffle=wrapper.shuffle, seed=wrapper.seed, drop_last=wrapper.drop_last)  # fmt: skip
    return update_dataloader(loader, sampler)


def batching(loader: Any) -> tuple[int | None, bool]:
    """A loader's per-rank batch size and ``drop_last``, whether it batches itself or through a batch sampler."""
    if loader.batch_size:
        return loader.batch_size, loader.drop_last
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(batch_sampler, "batch_size", None), bool(getattr(batch_sampler, "drop_last", False))


def epoch_order(sampler: DistributedSampler, epoch: int) -> list[int]:
    """The epoch's permutation, unpadded, exactly as ``DistributedSampler`` draws it."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if not sampler.shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(sampler.seed + epoch)
    return torch.randperm(n, generator=g).tolist()


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
        batch_size, drop_last = batching(loader)
        self._first: DataLoader | None = DataLoader(
            loader.dataset,
            batch_size=batch_size,
            sampler=tail,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=drop_last,
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


class RestartedEpoch(_ResumingLoader):
    """``data_position="epoch"``: the interrupted epoch is read again from its start, whole (its order the
    sampler's for that epoch), and Lightning counts the batches trained before the save on top, so the epoch ends
    when this iterator does; later epochs are the loader's own."""

    def __init__(self, loader: Any, epoch: int, done: int) -> None:
        self._loader, self._epoch, self._first, self._done = loader, epoch, True, done

    def __iter__(self) -> Any:
        if self._first:
            self._first = False
            from cuboid.compat import set_sampler_epoch

            set_sampler_epoch(self._loader, self._epoch)
        return iter(self._loader)

    def __len__(self) -> int:
        return self._done + len(self._loader)  # a loader without a length raises TypeError: Lightning's "no length"

    def state_dict(self) -> dict[str, Any]:
        return self._loader.state_dict() if isinstance(self._loader, TrackedLoader) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self._loader, TrackedLoader):
            self._loader.load_state_dict(state)


# --- loaders that keep their own state (torchdata's StatefulDataLoader, a streaming dataset) -------------------
class TrackedLoader(_ResumingLoader):
    """A train loader that keeps its own state (torchdata's ``StatefulDataLoader``, a streaming loader), with the
    state it had before each batch was drawn: Lightning draws one batch ahead of the step it runs, so the loader's
    own ``state_dict`` at a save is one batch past the batches trained, and a resume from it would skip one.
    :meth:`state_dict` gives the state after exactly the batches Lightning has trained in this epoch."""

    KEEP = 8  # states kept: Lightning draws at most ``prefetch_batches`` (1) ahead

    def __init__(self, loader: Any, progress: Any, resumed_after: int = 0) -> None:
        self._loader, self._progress, self._offset = loader, progress, resumed_after
        self._states: dict[int, dict[str, Any]] = {}

    def __iter__(self) -> Any:
        offset, self._offset, self._states = self._offset, 0, {}
        iterator = iter(self._loader)  # a restored state is taken up here
        drawn = offset
        while True:
            self._states[drawn] = self._loader.state_dict()
            self._states.pop(drawn - self.KEEP, None)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            drawn += 1
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def state_dict(self) -> dict[str, Any]:
        trained = self._progress.current.processed
        return self._states.get(trained) or self._loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loader.load_state_dict(state)


def keeps_state(loader: Any) -> bool:
    """Whether a train loader keeps a state of its own that Lightning saves and restores (``state_dict`` and
    ``load_state_dict``), not counting Cuboid's resume wrappers."""
    return not isinstance(loader, _ResumingLoader) and all(
        callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict")
    )
