"""The Lightning side of checkpoints: CuboidStrategy's save/load/remove hooks and mid-epoch resume.

Mixed into :class:`~cuboid.CuboidStrategy`; the on-disk formats and their checks live in
:mod:`cuboid.checkpoint` (sharded) and :mod:`cuboid.checkpoint_full` (one file). Lightning's own
model/optimizer state-dict hooks are no-ops here because the state is written and read directly.

``ModelCheckpoint(save_last="link")`` replaces ``last`` by delete-then-symlink, and deletes the old
top-k checkpoint right after issuing a save; Cuboid makes both safe: deletions wait for the pending
save, ``last`` is re-pointed atomically (a new link renamed over the old) only once its target is
complete, and a checkpoint that a ``last`` link still points to is deleted only after the link moved.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from cuboid import checkpoint as ckpt
from cuboid import checkpoint_full, compat

CHECKPOINT_FORMATS = ("sharded", "full")
_Path = str | os.PathLike


class CheckpointMixin:
    """Sharded (DCP) checkpoints, atomic and optionally asynchronous, reloadable on any layout."""

    async_checkpoint: bool
    checkpoint_format: str
    checkpoint_storage_writer: Any
    _deferred_removals: list[Path]
    _pending_save: Any
    _checkpoint_group: dist.ProcessGroup | None
    _resume_skip: int
    _param_order: list[str] | None  # the model's parameter names before a pipeline split (None without one)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is written shard by shard in save_checkpoint

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # written shard by shard in save_checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CuboidStrategy.save_checkpoint(..., storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        checkpoint.pop("state_dict", None)
        # Lightning leaves out optimizer_states for ModelCheckpoint(save_weights_only=True): so do we.
        optimizers = self.optimizers if checkpoint.pop("optimizer_states", None) is not None else []
        trainer = self.lightning_module.trainer
        batches = trainer.fit_loop.epoch_loop.batch_progress
        checkpoint["cuboid"] = {
            "layout": self.layout.sizes,
            "world_size": self.world_size,
            # Batches of the current epoch already trained: a resume skips them (mid-epoch resume). After the
            # epoch's last batch (a save at the epoch's end, or after fit) Lightning resumes with the next
            # epoch, which must not be skipped into.
            "batches_done_in_epoch": 0 if batches.is_last_batch else batches.current.processed,
        }
        assert self.model is not None
        self.wait_for_checkpoint()
        full = self.checkpoint_format == "full"
        if self._checkpoint_group is None and (self.async_checkpoint or (full and dist.get_backend() != "gloo")):
            self._checkpoint_group = dist.new_group(backend="gloo")
        if full:
            self._pending_save = checkpoint_full.save_full(
                path,
                self.model,
                optimizers,
                checkpoint,
                self.device_mesh,
                self._checkpoint_group,
                background=self.async_checkpoint,
                model_order=self._param_order,
            )
            return
        self._pending_save = ckpt.save_sharded(
            path,
            self.model,
            optimizers,
            checkpoint,
            self.checkpoint_storage_writer,
            async_group=self._checkpoint_group if self.async_checkpoint else None,
        )

    def wait_for_checkpoint(self) -> None:
        """Block until a background (async) save has been written and renamed into place."""
        if self._pending_save is not None:
            self._pending_save.join()
            self._pending_save = None

    @override
    def load_checkpoint(self, checkpoint_path: _Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        ckpt.check_loadable(path, allow_file=True)
        strict = self.lightning_module.strict_loading
        if path.is_file():
            meta = checkpoint_full.load_full(
                path, self.model, self.optimizers, strict, weights_only, model_order=self._param_order
            )
        else:
            meta = ckpt.load_sharded(path, self.model, self.optimizers, strict=strict, weights_only=weights_only)
        self._resume_skip = meta.get("cuboid", {}).get("batches_done_in_epoch", 0)
        return meta

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """After a mid-epoch resume, skip the batches of the epoch that were already trained."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._resume_skip and trainer is not None and trainer.training:
            skip = self._resume_skip
            dataloader = ckpt.SkipFirstBatches(dataloader, skip, trainer.fit_loop.epoch_progress.current.processed)
            self._resume_skip = 0
            rank_zero_info(f"Cuboid: resuming mid-epoch, skipping the {skip} batches of this epoch already trained")
        return dataloader

    @override
    def remove_checkpoint(self, filepath: _Path) -> None:
        # ModelCheckpoint deletes the previous top-k right after a save: never before the new one is complete,
        # and never while a `last` link still points to it (it is deleted once the link has moved).
        self.wait_for_checkpoint()
        if self.is_global_zero:
            path = Path(filepath)
            if not path.is_symlink() and _linked_from(path):
                self._deferred_removals.append(path)
            else:
                ckpt._remove(path)

    def guard_checkpoint_callbacks(self, callbacks: list[Any]) -> None:
        """Route ``ModelCheckpoint(save_last="link")``'s link update through :meth:`link_checkpoint`."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        for callback in callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last == "link":
                compat.route_link_checkpoint(callback, self.link_checkpoint)

    def link_checkpoint(self, trainer: Any, filepath: _Path, linkpath: _Path) -> None:
        """Point ``linkpath`` at ``filepath`` once that save is complete, replacing the old link atomically."""
        self.wait_for_checkpoint()
        target, link = Path(filepath), Path(linkpath)
        if self.is_global_zero and target.absolute() != link.absolute():
            fresh = link.with_name(f".{link.name}.link")
            ckpt._remove(fresh)
            fresh.symlink_to(os.path.relpath(target, link.parent))
            if link.is_symlink() or not link.exists():
                os.replace(fresh, link)  # atomic: readers see the old link or the new one
            else:
                ckpt._publish(fresh, link)  # a real checkpoint stood there: moved aside, then removed
            for path in [p for p in self._deferred_removals if not _linked_from(p)]:
                self._deferred_removals.remove(path)
                ckpt._remove(path)
        self.barrier()


def _linked_from(path: Path) -> bool:
    """True when a symlink beside ``path`` points to it (a ``last`` link of ModelCheckpoint)."""
    if not path.exists() or not path.parent.is_dir():
        return False
    target = path.resolve()
    return any(p.is_symlink() and p.resolve() == target for p in path.parent.iterdir() if p != path)
