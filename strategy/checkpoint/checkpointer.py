"""The checkpointer: how a CuboidStrategy saves, loads, links and removes checkpoints.

:class:`Checkpointer` owns everything about checkpoints that outlives one call: the format to write,
whether saves run in the background (and the pending one), the gloo process group those use, the
removals deferred while a ``last`` link still points at a checkpoint, the data position (a
:class:`~cuboid.checkpoint.resume.DataPosition`: what a save records of the data, where the next train loader
starts after a load), and the model's parameter order before a pipeline split. The strategy's Lightning hooks call
it in one line each; what it needs of the run (the trainer, this rank's data-parallel rank and degree) they hand it. The on-disk formats implement one interface (:mod:`cuboid.checkpoint.format`): Cuboid writes
:class:`~cuboid.checkpoint.sharded.ShardedFormat` or :class:`~cuboid.checkpoint.full.FullFormat`, and loads
those and :class:`~cuboid.checkpoint.lightning.LightningFormat` (Lightning's strategies' directories).

``ModelCheckpoint(save_last="link")`` replaces ``last`` by delete-then-symlink, and deletes the old
top-k checkpoint right after issuing a save; the checkpointer makes both safe: deletions wait for the
pending save, ``last`` is re-pointed atomically (a new link renamed over the old) only once its target is
complete, and a checkpoint that a ``last`` link still points to is deleted only after the link moved.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
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
    CheckpointError,
    CheckpointFormat,
    CheckpointReader,
    LiveWeights,
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
from cuboid.checkpoint.resume import DataPosition
from cuboid.checkpoint.sharded import CheckpointDamaged, ShardedFormat, checkpoints_newest_first
from cuboid.dropin import whole_weights
from cuboid.storage import RemotePath

FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (ShardedFormat(), FullFormat())}  # what Cuboid writes
READERS: tuple[CheckpointReader, ...] = (*FORMATS.values(), LightningFormat())  # what Cuboid loads


class Checkpointer:
    """Saves and loads a CuboidStrategy's checkpoints; see the module docstring for what it owns.

    Args:
        format: ``"sharded"`` or ``"full"``: what :meth:`save` writes (either loads).
        async_save: Write in the background once the state is copied to host memory.
        barrier: Waits for every rank (the strategy's barrier): :meth:`link` ends with it.
        position: The data position it saves and resumes (a fresh ``DataPosition("exact")`` when none is given).
    """

    def __init__(
        self,
        format: str = "sharded",
        async_save: bool = False,
        barrier: Callable[[], None] = lambda: None,
        position: DataPosition | None = None,
    ) -> None:
        self.format = format
        self.position = position if position is not None else DataPosition()
        self.async_save = async_save
        # Advanced: a callable (directory -> DCP StorageWriter) to write sharded checkpoints elsewhere or differently.
        self.storage_writer: Callable[[Path], Any] | None = None
        # The model's parameter names before a pipeline split (None without one): positions in Lightning's
        # optimizer states follow it.
        self.model_order: list[str] | None = None
        self._pending: Any = None
        self._group: dist.ProcessGroup | None = None
        self.checkpoint_io: Any = None  # a user's CheckpointIO plugin, which full files go through (use_checkpoint_io)
        self._stager: Any = None
        self._deferred_removals: list[Path] = []
        self._barrier = barrier
        # Set by the main job for ckpt_path=auto: a damaged checkpoint (checksums) makes way for the newest earlier
        # one that verifies, with a warning; otherwise the load stops, naming the damaged files.
        self.fall_back_when_damaged = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without what belongs to the running processes: its gloo group and a pending background save."""
        return {**vars(self), "_group": None, "_pending": None}

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
        layout: Mapping[str, int],
        mesh: Any,
        *,
        dp: tuple[int, int],
    ) -> None:
        """Write Lightning's ``checkpoint`` dict and the model/optimizer state to ``path`` (atomically), with where
        the data stands and the ``layout`` it was saved on (every degree, ``ep`` included: ``Layout.degrees``).
        ``dp``: this rank's data-parallel rank and the degree."""
        given = checkpoint.pop("state_dict", None)
        moved = [key for key, value in checkpoint.items() if isinstance(value, LiveWeights)]
        if (given and not isinstance(given, LiveWeights)) or moved:  # a callback's own (WeightAveraging's average)
            if self.format != "full":
                raise CheckpointError(
                    f"A callback put weights of its own in the checkpoint's state_dict (the live ones under {moved}), "
                    f"which CuboidStrategy(checkpoint_format={self.format!r}) cannot write as Lightning's DDP does: "
                    "set CuboidStrategy(checkpoint_format='full')."
                )
            checkpoint["state_dict"] = whole_weights(given or {})  # a collective for each DTensor, every rank
        # Lightning leaves out optimizer_states for ModelCheckpoint(save_weights_only=True): so do we.
        optimizers = optimizers if checkpoint.pop("optimizer_states", None) is not None else []
        data = self.position.saved(trainer, checkpoint, dp)
        checkpoint["cuboid"] = {"layout": dict(layout), "world_size": dist.get_world_size(), **data}
        self.write(path, module, optimizers, checkpoint, mesh)

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
                checkpoint_io=self.checkpoint_io,
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
        self,
        path: Path,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        strict: bool,
        weights_only: bool | None,
        dp: tuple[int, int] = (0, 1),
    ) -> dict[str, Any]:
        """Load ``path`` (a Cuboid directory or file, or a Lightning strategy's) into this layout, whatever format
        is set for saving; return Lightning's state. ``dp``: this rank's data-parallel rank and the degree, which
        the data position resumes on (a Fabric loop's load resumes no loader: one rank of one)."""
        check_loadable(path, allow_file=True)
        try:
            meta = self._load_one(path, module, optimizers, strict, weights_only)
        except CheckpointDamaged as damaged:
            if not self.fall_back_when_damaged:
                raise
            meta = self._load_previous(damaged, module, optimizers, strict, weights_only)
        self.position.resume(meta, dp)
        return meta

    def _load_one(
        self, path: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, weights_only: bool | None
    ) -> dict[str, Any]:
        fmt = next((reader for reader in READERS if reader.recognizes(path)), FORMATS["sharded"])
        request = LoadRequest(path, module, optimizers, strict, weights_only, self.model_order, self.checkpoint_io)
        return fmt.load(request)

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

    def remove(self, path: Path) -> None:
        """ModelCheckpoint deletes the previous top-k right after a save: never before the new one is complete,
        and never while a `last` link still points to it (it is deleted once the link has moved)."""
        self.wait()
        if rank() == 0:
            if not path.is_symlink() and _linked_from(path):
                self._deferred_removals.append(path)
            elif self.checkpoint_io is not None:  # the user's plugin removes what it wrote, as under DDP
                self.checkpoint_io.remove_checkpoint(path)
            else:
                remove_path(path)

    def guard_callbacks(self, callbacks: list[Any]) -> None:
        """Route ``ModelCheckpoint(save_last="link")``'s link update through :meth:`link`."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        for callback in callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last == "link":
                compat.route_link_checkpoint(callback, self.link)

    def use_checkpoint_io(self, checkpoint_io: Any) -> None:
        """A ``CheckpointIO`` plugin (``Trainer(plugins=[...])``, a library's own): with the full format, one file
        on rank 0, written with its ``save_checkpoint``, read with its ``load_checkpoint`` and removed with its
        ``remove_checkpoint``, as Lightning's DDP uses it; Lightning's default ``TorchCheckpointIO`` leaves Cuboid's
        own atomic writes. Refused by name: a plugin with the sharded format (a directory of every rank's shards,
        which a plugin's one file cannot hold), and ``AsyncCheckpointIO`` (Cuboid's own async saves do that)."""
        from lightning.fabric.plugins import TorchCheckpointIO
        from lightning.pytorch.plugins import AsyncCheckpointIO

        self.checkpoint_io = None
        if checkpoint_io is None or type(checkpoint_io) is TorchCheckpointIO:
            return
        name = type(checkpoint_io).__name__
        if isinstance(checkpoint_io, AsyncCheckpointIO):
            raise TypeError(
                f"Trainer(plugins=[{name}(...)]): CuboidStrategy writes its checkpoints in the background itself and "
                "cannot use a CheckpointIO plugin for it. For saves in the background, set "
                "CuboidStrategy(async_checkpoint=True); remove the plugin."
            )
        if self.format != "full":
            raise TypeError(
                f"Trainer(plugins=[{name}(...)]): a CheckpointIO plugin writes each checkpoint as one file, and "
                f"CuboidStrategy(checkpoint_format={self.format!r}) writes a directory of shards, every rank its own. "
                f"Set CuboidStrategy(checkpoint_format='full'): one file, gathered on rank 0 and written with "
                f"{name}.save_checkpoint (read with its load_checkpoint); or remove the plugin."
            )
        self.checkpoint_io = checkpoint_io

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
