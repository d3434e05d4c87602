"""The data position: where a run's train data stands when a checkpoint is taken, and where the next train loader
starts after a load.

:class:`DataPosition` is what a :class:`~cuboid.checkpoint.Checkpointer` holds for it: the ``data_position`` setting
(``"exact"`` or ``"epoch"``), what a save records (the dp degree, the loaders, the batches done in the epoch, the
samples consumed over every dp rank, each dp rank's loader state where a loader keeps one), the plan a load or a
replica group's heal leaves for the next train loader, and that loader (one of
:mod:`cuboid.checkpoint.resume.loaders`' wrappers).
Nothing here reads the strategy: the caller hands over this rank's data-parallel rank and the degree.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DistributedSampler

from cuboid.checkpoint.format import CheckpointError
from cuboid.checkpoint.resume.loaders import (
    RestartedEpoch,
    ResumedLoader,
    SkipFirstBatches,
    TrackedLoader,
    batching,
    deal_as_dataloader,
    distributed_sampler,
    keeps_state,
)

DATA_POSITIONS = ("exact", "epoch")  # the data_position settings


def position(samples: int, epoch: int, sampler: DistributedSampler) -> dict[str, Any]:
    """What a checkpoint stores: the epoch, the samples consumed in it over all dp ranks, and what the order
    depends on (the sampler's seed and shuffle, the dataset's length)."""
    return {"epoch": epoch, "samples": samples, "seed": sampler.seed, "shuffle": sampler.shuffle,
            "length": len(sampler.dataset)}  # type: ignore[arg-type]  # fmt: skip


def save_position(trainer: Any, batches_done: int, resumed_at: tuple[int, ...]) -> dict[str, Any] | None:
    """The data position of a save ``batches_done`` batches into the epoch, for a loader Lightning deals with a
    ``DistributedSampler``; None for any other. ``resumed_at``: (epoch, samples, batches) where this run resumed."""
    loader = trainer.train_dataloader
    sampler, (batch_size, _) = distributed_sampler(loader), batching(loader)
    if sampler is None or not batch_size:
        return None
    epoch = trainer.current_epoch
    _, start, at = resumed_at if resumed_at[0] == epoch else (epoch, 0, 0)
    samples = start + (batches_done - at) * batch_size * sampler.num_replicas
    return position(min(samples, len(sampler.dataset)), epoch, sampler)


def check_position(found: dict[str, Any], sampler: DistributedSampler) -> None:
    """Refuse a data position taken over another dataset or order, naming both, before any step."""
    now = position(0, found["epoch"], sampler)
    for key, what in (("length", "samples in the dataset"), ("seed", "sampler seed"), ("shuffle", "shuffle")):
        if found[key] != now[key]:
            raise CheckpointError(
                f"the checkpoint was taken at sample {found['samples']} of epoch {found['epoch']} with {found[key]} "
                f"{what}; this run has {now[key]}, so that position means other samples. Resume with the same "
                f"dataset and seed (seed_everything, or the main job's seed), or start from a checkpoint taken at an "
                "epoch's end. No step was run and nothing was overwritten."
            )


def fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's fit-loop entry of a checkpoint dict (where it keeps each train loader's ``state_dict``)."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})


def gather_loader_states(checkpoint: dict[str, Any], dp_rank: int, loaders: list[str]) -> dict[str, Any] | None:
    """Every data-parallel rank's train-loader states, for a mid-epoch save without a data position: Lightning
    keeps only this rank's in the checkpoint dict, and a sharded checkpoint writes that dict once. One object
    all-gather over the world, at the save (not in a step). None when no loader keeps a state."""
    mine = fit_loop_state(checkpoint).get("combined_loader") or []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dp_rank, mine))
    states = dict(everyone)
    if not any(any(s) for s in states.values()):
        return None
    return {"loaders": loaders, "states": states}


def refuse_other_degree(loaders: list[str], saved: int, now: int, at: int, why: str) -> None:
    """The error for a mid-epoch checkpoint whose data state cannot be dealt over another dp degree."""
    names = ", ".join(loaders) or "the train loader"
    raise CheckpointError(
        f"the checkpoint was taken {at} batches into an epoch over {saved} data-parallel ranks, and this run has "
        f"{now}; {names} {why}, which cannot be dealt over {now}. Choose one: resume on {saved} data-parallel ranks "
        "(the layout's dp_replicate x dp_shard); or pass data_position='epoch' to CuboidStrategy to read the "
        "interrupted epoch again from its start on this layout; or resume from a checkpoint taken at an epoch's "
        "end. A loader Lightning deals with its DistributedSampler (a map-style dataset) resumes on any degree. "
        "No step was run and nothing was overwritten."
    )


def plan_resume(meta: dict[str, Any], mode: str, dp_rank: int, dp_size: int) -> tuple[int, bool]:
    """How a mid-epoch checkpoint's data resumes on ``dp_size`` data-parallel ranks: returns (batches to skip by
    drawing them, whether to read the epoch again from its start), and edits ``meta`` so Lightning restores each
    rank its own loader state (same degree) or none. Refuses, before any step, what another degree cannot take.

    * ``mode="epoch"``: no loader state, no position; the epoch is read again from its start.
    * a data position (a ``DistributedSampler``): any degree, handled by :class:`ResumedLoader`.
    * loader states (torchdata's ``StatefulDataLoader``, a stateful streaming dataset): the same degree gets each
      dp rank's own state back through Lightning (exact, nothing skipped is read); another degree is refused.
    * neither (a loader with its own sampler): the epoch's trained batches drawn and dropped at the same degree;
      another degree is refused (the batches were counted per rank).
    """
    cuboid = meta.get("cuboid", {})
    done, saved = cuboid.get("batches_done_in_epoch", 0), cuboid.get("dp")
    found, fit = cuboid.get("loader_states"), fit_loop_state(meta)
    if not done:
        return 0, False
    if mode == "epoch":
        fit.pop("combined_loader", None)
        cuboid["data_position"] = None
        return done, True
    if cuboid.get("data_position"):
        return done, False
    if found:
        if saved != dp_size:
            refuse_other_degree(found["loaders"], saved, dp_size, done, "keeps one state per data-parallel rank")
        fit["combined_loader"] = found["states"][dp_rank]
        return 0, False
    if saved is not None and saved != dp_size:
        refuse_other_degree(cuboid.get("loaders", []), saved, dp_size, done, "has no data position to resume from")
    return done, False


class DataPosition:
    """Where a run's train data stands and where its next train loader starts; see the module docstring.

    Args:
        mode: Where a mid-epoch resume starts: ``"exact"`` (at the checkpoint's data position) or ``"epoch"`` (the
            interrupted epoch read again from its start, on any layout).
    """

    def __init__(self, mode: str = "exact") -> None:
        self.mode = mode
        self._skip = 0  # batches of the epoch the next train loader skips (drawn, or counted by a wrapper)
        self._found: dict[str, Any] | None = None  # the loaded data position, until the next train loader takes it
        self._resumed_at: tuple[int, ...] = (-1, 0, 0)  # (epoch, samples, batches) where this run resumed
        self._restart_epoch = False
        self._restored_states = 0  # batches done in the epoch of loader states restored by Lightning

    @property
    def mode(self) -> str:
        """``"exact"`` or ``"epoch"``: the ``data_position`` setting."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in DATA_POSITIONS:
            raise ValueError(
                f"data_position={value!r}; choose 'exact' (resume where the checkpoint was taken) or 'epoch' (read "
                "the interrupted epoch again from its start)."
            )
        self._mode = value

    def state(self, trainer: Any, done: int, dp_size: int) -> dict[str, Any]:
        """Where the data stands ``done`` batches into the epoch (0: at its start), for a checkpoint or a heal:
        the dp degree (``dp_size``), the loaders, the batches done (a mid-epoch resume skips them) and the samples
        consumed over every dp rank (a resume on any dp degree starts there). No collective."""
        loader = trainer.train_dataloader
        return {
            "dp": dp_size,
            "loaders": [type(getattr(one, "_loader", one)).__name__ for one in getattr(loader, "flattened", [loader])],
            "batches_done_in_epoch": done,
            "data_position": save_position(trainer, done, self._resumed_at) if done else None,
        }

    def saved(self, trainer: Any, checkpoint: dict[str, Any], dp: tuple[int, int]) -> dict[str, Any]:
        """What a save of Lightning's ``checkpoint`` dict records of the data (:meth:`state`), with every dp rank's
        loader state for a mid-epoch save without a data position (an object all-gather over the world, on every
        rank alike). ``dp``: this rank's data-parallel rank and the degree."""
        epoch, batches = trainer.fit_loop.epoch_progress.current, trainer.fit_loop.epoch_loop.batch_progress
        # Lightning resumes mid-epoch only from an epoch its own counters call unfinished (started, not yet
        # processed); a save at the epoch's end, after fit, or after max_steps stopped fit mid-epoch resumes with
        # the next epoch from its start, which must not be skipped into.
        mid_epoch = epoch.started > epoch.processed and not batches.is_last_batch
        data = self.state(trainer, batches.current.processed if mid_epoch else 0, dp[1])
        if mid_epoch and data["data_position"] is None:  # each dp rank's loader state, if kept
            data["loader_states"] = gather_loader_states(checkpoint, dp[0], data["loaders"])
        return data

    def resume(self, meta: dict[str, Any], dp: tuple[int, int]) -> None:
        """Plan the next train loader from a loaded checkpoint's ``meta`` (edited so that Lightning restores each
        rank its own loader state, or none: :func:`plan_resume`). ``dp``: this rank's data-parallel rank and the
        degree."""
        self._plan(meta, dp)
        restored = self._skip == 0 and meta.get("cuboid", {}).get("loader_states")
        self._restored_states = meta["cuboid"]["batches_done_in_epoch"] if restored else 0

    def take(self, state: dict[str, Any], dp: tuple[int, int]) -> None:
        """Take a data state (:meth:`state`, a live replica group's) as a checkpoint's: the next train loader
        starts there. ``dp``: this rank's data-parallel rank and the degree."""
        self._plan({"cuboid": state}, dp)

    def _plan(self, meta: dict[str, Any], dp: tuple[int, int]) -> None:
        self._skip, self._restart_epoch = plan_resume(meta, self.mode, *dp)
        self._found = meta.get("cuboid", {}).get("data_position")

    def loader(self, dataloader: Any, trainer: Any) -> Any:
        """The train loader for this run (:func:`plan_resume` says which case): one Lightning deals with a
        ``DistributedSampler`` starts at the checkpoint's data position, reading nothing it skips; one with its own
        state is tracked so a save keeps the trained batches' state; with ``data_position="epoch"`` the interrupted
        epoch is read again; any other skips the epoch's trained batches by drawing them (once)."""
        if trainer is not None and trainer.training:
            dataloader = deal_as_dataloader(dataloader)
        found = self._found
        sampler = distributed_sampler(dataloader)
        if found and sampler is not None and trainer is not None and trainer.training:
            check_position(found, sampler)
            epoch, samples, done = found["epoch"], found["samples"], self._skip
            self._found, self._skip, self._resumed_at = None, 0, (epoch, samples, done)
            rank_zero_info(
                f"Cuboid: resuming epoch {epoch} at sample {samples} of {found['length']} (counted over every "
                f"data-parallel rank), on {sampler.num_replicas} of them; the samples before it are not read"
            )
            return ResumedLoader(dataloader, sampler, epoch, samples, self._resumed_at[2])
        if trainer is None or not trainer.training:
            return dataloader
        if self._restart_epoch:
            epoch, done = trainer.fit_loop.epoch_progress.current.processed, self._skip
            self._restart_epoch, self._skip = False, 0
            if sampler is None and keeps_state(dataloader):
                dataloader = TrackedLoader(dataloader, trainer.fit_loop.epoch_loop.batch_progress, done)
            rank_zero_info(f"Cuboid: data_position='epoch': reading epoch {epoch} again from its start")
            return RestartedEpoch(dataloader, epoch, done)
        if sampler is None and keeps_state(dataloader) and not self._skip:
            # Lightning restores this rank's own state into it; the states a save keeps are the trained batches'
            done, self._restored_states = self._restored_states, 0
            return TrackedLoader(dataloader, trainer.fit_loop.epoch_loop.batch_progress, done)
        if self._skip:
            skip = self._skip
            dataloader = SkipFirstBatches(dataloader, skip, trainer.fit_loop.epoch_progress.current.processed)
            self._skip = 0
            rank_zero_info(f"Cuboid: resuming mid-epoch, skipping the {skip} batches of this epoch already trained")
        return dataloader
