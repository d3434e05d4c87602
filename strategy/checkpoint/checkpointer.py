"""The checkpointer: how a CuboidStrategy saves, loads, links and removes checkpoints.

:class:`Checkpointer` owns everything about checkpoints that outlives one call: the format to write,
whether saves run in the background (and the pending one), the gloo process group those use, the
removals deferred while a ``last`` link still points at a checkpoint, the batches a mid-epoch resume
skips, and the model's parameter order before a pipeline split. The strategy's Lightning hooks call it
in one line each. The on-disk formats implement one interface (:mod:`cuboid.checkpoint.format`): Cuboid writes
:class:`~cuboid.checkpoint.sharded.ShardedFormat` or :class:`~cuboid.checkpoint.full.FullFormat`, and loads
those and :class:`~cuboid.checkpoint.lightning.LightningFormat` (Lightning's strategies' directories).

``ModelCheckpoint(save_last="link")`` replaces ``last`` by delete-then-symlink, and deletes the old
top-k checkpoint right after issuing a save; the checkpointer makes both safe: deletions wait for the
pending save, ``last`` is re-pointed atomically (a new link renamed over the old) only once its target is
complete, and a checkpoint that a ``last`` link still points to is deleted only after the link moved.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from cuboid import compat
from cuboid.adapters import adapter_configs
from cuboid.checkpoint.format import (
    CheckpointFormat,
    CheckpointReader,
    LoadRequest,
    SaveRequest,
    check_loadable,
    publish,
    rank,
    remove_path,
    storable_hparams,
)
from cuboid.checkpoint.full import FullFormat
from cuboid.checkpoint.lightning import LightningFormat
from cuboid.checkpoint.resume import (
    DATA_POSITIONS,
    RestartedEpoch,
    ResumedLoader,
    SkipFirstBatches,
    TrackedLoader,
    check_position,
    deal_as_dataloader,
    distributed_sampler,
    gather_loader_states,
    keeps_state,
    plan_resume,
    save_position,
)
from cuboid.checkpoint.sharded import CheckpointDamaged, ShardedFormat, checkpoints_newest_first
from cuboid.storage import RemotePath

FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (ShardedFormat(), FullFormat())}  # what Cuboid writes
READERS: tuple[CheckpointReader, ...] = (*FORMATS.values(), LightningFormat())  # what Cuboid loads


class Checkpointer:
    """Saves and loads a CuboidStrategy's checkpoints; see the module docstring for what it owns.

    Args:
        format: ``"sharded"`` or ``"full"``: what :meth:`save` writes (either loads).
        async_save: Write in the background once the state is copied to host memory.
        barrier: Waits for every rank (the strategy's barrier): :meth:`link` ends with it.
    """

    def __init__(
        self, format: str = "sharded", async_save: bool = False, barrier: Callable[[], None] = lambda: None
    ) -> None:
        self.format = format
        self.async_save = async_save
        # Advanced: a callable (directory -> DCP StorageWriter) to write sharded checkpoints elsewhere or differently.
        self.storage_writer: Callable[[Path], Any] | None = None
        # The model's parameter names before a pipeline split (None without one): positions in Lightning's
        # optimizer states follow it.
        self.model_order: list[str] | None = None
        self._pending: Any = None
        self._group: dist.ProcessGroup | None = None
        self._stager: Any = None
        self._deferred_removals: list[Path] = []
        self._resume_skip = 0
        self._resume_position: dict[str, Any] | None = None
        self._resumed_at: tuple[int, ...] = (-1, 0, 0)  # (epoch, samples, batches) where this run resumed
        self._restart_epoch = False
        self._restored_states = 0  # batches done in the epoch of loader states restored by Lightning
        self.data_position = "exact"
        self.dp = (0, 1)  # this rank's data-parallel rank and the degree, set by the strategy before a load
        self._barrier = barrier
        # Set by the main job for ckpt_path=auto: a damaged checkpoint (checksums) makes way for the newest earlier
        # one that verifies, with a warning; otherwise the load stops, naming the damaged files.
        self.fall_back_when_damaged = False

    def make_group(self) -> None:
        """The gloo process group checkpoints use when they need one (async saves; the full format on NCCL), made
        by every rank at setup: made lazily, a host-networking problem (a multi-NIC node) would show only at the
        first save, hours into a run."""
        if self._group is not None or not dist.is_initialized():
            return
        if self.async_save or (FORMATS[self.format].needs_gloo_group and dist.get_backend() != "gloo"):
            self._group = dist.new_group(backend="gloo")

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The gloo group :meth:`make_group` made, if any."""
        return self._group

    @property
    def stager(self) -> Any:
        """The host staging of async saves, kept across saves: its buffers (pinned on GPUs, for fast copies) are
        allocated at the first save and reused by the next ones, instead of fresh pageable memory each time."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=pinned,
                    use_shared_memory=False,
                    use_async_staging=False,  # copied before save() returns; written in the background
                    use_non_blocking_copy=False,
                )
            )
        return self._stager

    @property
    def data_position(self) -> str:
        """Where a mid-epoch resume starts: ``"exact"`` (at the checkpoint's data position) or ``"epoch"`` (the
        interrupted epoch read again from its start, on any layout)."""
        return self._data_position

    @data_position.setter
    def data_position(self, value: str) -> None:
        if value not in DATA_POSITIONS:
            raise ValueError(
                f"data_position={value!r}; choose 'exact' (resume where the checkpoint was taken) or 'epoch' (read "
                "the interrupted epoch again from its start)."
            )
        self._data_position = value

    @property
    def format(self) -> str:
        return self._format

    @format.setter
    def format(self, value: str) -> None:
        if value not in FORMATS:
            raise ValueError(f"checkpoint_format={value!r}; choose 'sharded' (default) or 'full'.")
        self._format = value

    def save(
        self,
        path: Path,
        checkpoint: dict[str, Any],
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        trainer: Any,
        layout_sizes: tuple[int, ...],
        mesh: Any,
    ) -> None:
        """Write Lightning's ``checkpoint`` dict and the model/optimizer state to ``path`` (atomically)."""
        checkpoint.pop("state_dict", None)
        # Lightning leaves out optimizer_states for ModelCheckpoint(save_weights_only=True): so do we.
        optimizers = optimizers if checkpoint.pop("optimizer_states", None) is not None else []
        epoch, batches = trainer.fit_loop.epoch_progress.current, trainer.fit_loop.epoch_loop.batch_progress
        # Lightning resumes mid-epoch only from an epoch its own counters call unfinished (started, not yet
        # processed); a save at the epoch's end, after fit, or after max_steps stopped fit mid-epoch resumes with
        # the next epoch from its start, which must not be skipped into.
        mid_epoch = epoch.started > epoch.processed and not batches.is_last_batch
        data = self.data_state(trainer, batches.current.processed if mid_epoch else 0)
        checkpoint["cuboid"] = {"layout": layout_sizes, "world_size": dist.get_world_size(), **data}
        if mid_epoch and data["data_position"] is None:  # each dp rank's loader state, if kept
            dp_rank = trainer.strategy.distributed_sampler_kwargs["rank"]
            checkpoint["cuboid"]["loader_states"] = gather_loader_states(checkpoint, dp_rank, data["loaders"])
        self.write(path, module, optimizers, checkpoint, mesh)

    def data_state(self, trainer: Any, done: int) -> dict[str, Any]:
        """Where the data stands ``done`` batches into the epoch (0: at its start), for a checkpoint or a heal:
        the dp degree, the loaders, the batches done (a mid-epoch resume skips them) and the samples consumed
        over every dp rank (a resume on any dp degree starts there). No collective."""
        loader = trainer.train_dataloader
        return {
            "dp": trainer.strategy.distributed_sampler_kwargs["num_replicas"],
            "loaders": [type(getattr(one, "_loader", one)).__name__ for one in getattr(loader, "flattened", [loader])],
            "batches_done_in_epoch": done,
            "data_position": save_position(trainer, done, self._resumed_at) if done else None,
        }

    def resume_data(self, state: dict[str, Any], dp: tuple[int, int]) -> None:
        """Take a data state (:meth:`data_state`, a live replica group's) as a checkpoint's: the next train loader
        starts there. ``dp``: this rank's data-parallel rank and the degree."""
        self.dp = dp
        self._resume_skip, self._restart_epoch = plan_resume({"cuboid": state}, self.data_position, *dp)
        self._resume_position = state.get("data_position")

    def write(
        self, path: Path, module: nn.Module, optimizers: Sequence[Optimizer], state: dict[str, Any], mesh: Any
    ) -> None:
        """Write ``module``'s and ``optimizers``' shards and ``state`` (Lightning's checkpoint dict, or a Fabric
        loop's other entries) to ``path`` in the format set, in the background when saves are async."""
        self.wait()
        storable_hparams(state)  # a module among the hyper-parameters: left out with a warning, not a crash
        adapters = adapter_configs(module)
        if adapters:  # PEFT adapters: their configs, so that `python -m cuboid.export --peft` needs no model
            state.setdefault("cuboid", {})["adapters"] = adapters
        fmt = FORMATS[self.format]
        self.make_group()  # made at setup; again here only if async saves or the format were switched on since
        self._pending = fmt.save(
            SaveRequest(
                path,
                module,
                optimizers,
                state,
                mesh=mesh,
                group=self._group,
                background=self.async_save,
                model_order=self.model_order,
                storage_writer=self.storage_writer,
                stager=self.stager if self.async_save else None,
            )
        )

    def wait(self, raise_error: bool = True) -> None:
        """Block until a background (async) save has been written and renamed into place; raise its
        :class:`~cuboid.checkpoint.CheckpointError` if it failed (only log it with ``raise_error=False``)."""
        if self._pending is not None:
            self._pending.join()
            error, self._pending = getattr(self._pending, "error", None), None
            if error is not None:
                if raise_error:
                    raise error
                rank_zero_info(f"Cuboid: {error}")

    def settle(self) -> None:
        """Block until a background save has finished, keeping its outcome for :meth:`failure` (at the end of
        training, so that a failure that happens after the last step is still raised on every rank)."""
        if self._pending is not None:
            self._pending.join()

    def failure(self) -> BaseException | None:
        """The error of a background save that has finished and failed (None while it runs or if it succeeded);
        checked by every rank after each optimizer step, without waiting."""
        pending = self._pending
        if pending is None or pending.is_alive():
            return None
        return getattr(pending, "error", None)

    def load(
        self, path: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, weights_only: bool | None
    ) -> dict[str, Any]:
        """Load ``path`` (a Cuboid directory or file, or a Lightning strategy's) into this layout, whatever format
        is set for saving; return Lightning's state."""
        check_loadable(path, allow_file=True)
        try:
            meta = self._load_one(path, module, optimizers, strict, weights_only)
        except CheckpointDamaged as damaged:
            if not self.fall_back_when_damaged:
                raise
            meta = self._load_previous(damaged, module, optimizers, strict, weights_only)
        self._resume_skip, self._restart_epoch = plan_resume(meta, self.data_position, *self.dp)
        restored = self._resume_skip == 0 and meta.get("cuboid", {}).get("loader_states")
        self._restored_states = meta["cuboid"]["batches_done_in_epoch"] if restored else 0
        self._resume_position = meta.get("cuboid", {}).get("data_position")
        return meta

    def _load_one(
        self, path: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, weights_only: bool | None
    ) -> dict[str, Any]:
        fmt = next((reader for reader in READERS if reader.recognizes(path)), FORMATS["sharded"])
        return fmt.load(LoadRequest(path, module, optimizers, strict, weights_only, self.model_order))

    def _load_previous(
        self,
        damaged: CheckpointDamaged,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        strict: bool,
        weights_only: bool | None,
    ) -> dict[str, Any]:
        """The newest older checkpoint beside a damaged one that verifies (``fall_back_when_damaged``: what the
        main job's ``ckpt_path=auto`` asks); the damaged one is kept. Raises the first error when none does."""
        bad = damaged.path.resolve()
        older = [p for p in checkpoints_newest_first(bad.parent) if p != bad]
        for candidate in older:
            try:
                meta = self._load_one(candidate, module, optimizers, strict, weights_only)
            except CheckpointDamaged as also:
                rank_zero_warn(f"Cuboid: {also}")
                continue
            rank_zero_warn(
                f"Cuboid: {damaged} Resumed from {candidate} instead, the newest earlier checkpoint that verifies; "
                f"{damaged.path} is kept as it is."
            )
            return meta
        raise damaged

    def resume_loader(self, dataloader: Any, trainer: Any) -> Any:
        """The train loader for this run (:func:`~cuboid.checkpoint.resume.plan_resume` says which case): one
        Lightning deals with a ``DistributedSampler`` starts at the checkpoint's data position, reading nothing
        it skips; one with its own state is tracked so a save keeps the trained batches' state; with
        ``data_position="epoch"`` the interrupted epoch is read again; any other skips the epoch's trained
        batches by drawing them (once)."""
        if trainer is not None and trainer.training:
            dataloader = deal_as_dataloader(dataloader)
        found = self._resume_position
        sampler = distributed_sampler(dataloader)
        if found and sampler is not None and trainer is not None and trainer.training:
            check_position(found, sampler)
            epoch, samples, done = found["epoch"], found["samples"], self._resume_skip
            self._resume_position, self._resume_skip, self._resumed_at = None, 0, (epoch, samples, done)
            rank_zero_info(
                f"Cuboid: resuming epoch {epoch} at sample {samples} of {found['length']} (counted over every "
                f"data-parallel rank), on {sampler.num_replicas} of them; the samples before it are not read"
            )
            return ResumedLoader(dataloader, sampler, epoch, samples, self._resumed_at[2])
        if trainer is None or not trainer.training:
            return dataloader
        if self._restart_epoch:
            epoch, done = trainer.fit_loop.epoch_progress.current.processed, self._resume_skip
            self._restart_epoch, self._resume_skip = False, 0
            if sampler is None and keeps_state(dataloader):
                dataloader = TrackedLoader(dataloader, trainer.fit_loop.epoch_loop.batch_progress, done)
            rank_zero_info(f"Cuboid: data_position='epoch': reading epoch {epoch} again from its start")
            return RestartedEpoch(dataloader, epoch, done)
        if sampler is None and keeps_state(dataloader) and not self._resume_skip:
            # Lightning restores this rank's own state into it; the states a save keeps are the trained batches'
            done, self._restored_states = self._restored_states, 0
            return TrackedLoader(dataloader, trainer.fit_loop.epoch_loop.batch_progress, done)
        if self._resume_skip:
            skip = self._resume_skip
            dataloader = SkipFirstBatches(dataloader, skip, trainer.fit_loop.epoch_progress.current.processed)
            self._resume_skip = 0
            rank_zero_info(f"Cuboid: resuming mid-epoch, skipping the {skip} batches of this epoch already trained")
        return dataloader

    def remove(self, path: Path) -> None:
        """ModelCheckpoint deletes the previous top-k right after a save: never before the new one is complete,
        and never while a `last` link still points to it (it is deleted once the link has moved)."""
        self.wait()
        if rank() == 0:
            if not path.is_symlink() and _linked_from(path):
                self._deferred_removals.append(path)
            else:
                remove_path(path)

    def guard_callbacks(self, callbacks: list[Any]) -> None:
        """Route ``ModelCheckpoint(save_last="link")``'s link update through :meth:`link`."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        for callback in callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last == "link":
                compat.route_link_checkpoint(callback, self.link)

    @staticmethod
    def refuse_checkpoint_io(checkpoint_io: Any) -> None:
        """A ``CheckpointIO`` plugin (``Trainer(plugins=[...])``) would be ignored: Cuboid writes and reads its
        checkpoints itself (every rank its own shards), so any other than Lightning's default is refused by name."""
        from lightning.fabric.plugins import TorchCheckpointIO

        if type(checkpoint_io) is not TorchCheckpointIO:
            name = type(checkpoint_io).__name__
            hint = " For saves in the background, set CuboidStrategy(async_checkpoint=True)." if "Async" in name else ""
            raise TypeError(
                f"Trainer(plugins=[{name}(...)]): CuboidStrategy writes its checkpoints with "
                f"torch.distributed.checkpoint (each rank its own shards) and cannot use a CheckpointIO plugin.{hint} "
                "Remove the plugin; CuboidStrategy(checkpoint_format='full') writes one file instead."
            )

    def link(self, trainer: Any, filepath: str | os.PathLike, linkpath: str | os.PathLike) -> None:
        """Point ``linkpath`` at ``filepath`` once that save is complete, replacing the old link atomically."""
        self.wait()
        target, link = Path(filepath), Path(linkpath)
        if rank() == 0 and target.absolute() != link.absolute():
            fresh = link.with_name(f".{link.name}.link")
            remove_path(fresh)
            fresh.symlink_to(os.path.relpath(target, link.parent))
            if link.is_symlink() or not link.exists():
                os.replace(fresh, link)  # atomic: readers see the old link or the new one
            else:
                publish(fresh, link)  # a real checkpoint stood there: moved aside, then removed
            for path in [p for p in self._deferred_removals if not _linked_from(p)]:
                self._deferred_removals.remove(path)
                remove_path(path)
        self._barrier()


def _linked_from(path: Path) -> bool:
    """True when a symlink beside ``path`` points to it (a ``last`` link of ModelCheckpoint; none remote)."""
    if isinstance(path, RemotePath) or not path.exists() or not path.parent.is_dir():
        return False
    target = path.resolve()
    return any(p.is_symlink() and p.resolve() == target for p in path.parent.iterdir() if p != path)
