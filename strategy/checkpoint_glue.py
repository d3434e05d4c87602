"""The Lightning side of checkpoints: CuboidStrategy's save/load/remove hooks and mid-epoch resume.

Mixed into :class:`~cuboid.CuboidStrategy`; the on-disk format and its checks live in
:mod:`cuboid.checkpoint`. Lightning's own model/optimizer state-dict hooks are no-ops here because
the shards are written and read by DCP directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from cuboid import checkpoint as ckpt


class CheckpointMixin:
    """Sharded (DCP) checkpoints, atomic and optionally asynchronous, reloadable on any layout."""

    async_checkpoint: bool
    checkpoint_storage_writer: Any
    _pending_save: Any
    _checkpoint_group: dist.ProcessGroup | None
    _resume_skip: int

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is written shard by shard in save_checkpoint

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # written shard by shard in save_checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CuboidStrategy.save_checkpoint(..., storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        trainer = self.lightning_module.trainer
        checkpoint["cuboid"] = {
            "layout": self.layout.sizes,
            "world_size": self.world_size,
            # batches of the current epoch already trained: resume skips them (mid-epoch resume)
            "batches_done_in_epoch": trainer.fit_loop.epoch_loop.batch_progress.current.processed,
        }
        assert self.model is not None
        self.wait_for_checkpoint()
        if self.async_checkpoint and self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        self._pending_save = ckpt.save_sharded(
            path,
            self.model,
            self.optimizers,
            checkpoint,
            self.checkpoint_storage_writer,
            async_group=self._checkpoint_group if self.async_checkpoint else None,
        )

    def wait_for_checkpoint(self) -> None:
        """Block until a background (async) save has been written and renamed into place."""
        if self._pending_save is not None:
            self._pending_save.join()
            self._pending_save = None

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        meta = ckpt.load_sharded(path, self.model, self.optimizers, strict=self.lightning_module.strict_loading)
        self._resume_skip = meta.get("cuboid", {}).get("batches_done_in_epoch", 0)
        return meta

    def process_dataloader(self, dataloader: Any) -> Any:
        """After a mid-epoch resume, skip the batches of the epoch that were already trained."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._resume_skip and trainer is not None and trainer.training:
            skip = self._resume_skip
            dataloader = ckpt.SkipFirstBatches(dataloader, skip, trainer.fit_loop.epoch_progress.current.processed)
            self._resume_skip = 0
            rank_zero_info(f"Cuboid: resuming mid-epoch, skipping the {skip} batches of this epoch already trained")
        return dataloader

    def remove_checkpoint(self, filepath: _PATH) -> None:
        # ModelCheckpoint deletes the previous top-k right after a save: never before the new one is complete.
        self.wait_for_checkpoint()
        if self.is_global_zero:
            import shutil

            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
