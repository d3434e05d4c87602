"""The strategy's checkpoint hooks: Lightning's save, load and remove calls, each delegated to the strategy's
:class:`~cuboid.checkpoint.Checkpointer` in one line. Model and optimizer state never pass through Lightning's
dicts: the formats write and read them shard by shard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from cuboid import compat
from cuboid.checkpoint.checkpointer import Checkpointer
from cuboid.checkpoint.format import LiveWeights
from cuboid.checkpoint.resume import restored_names
from cuboid.dropin import check_sampler_ranks, keep_library_batches
from cuboid.storage import to_path


class CheckpointHooks:
    """Mixed into :class:`cuboid.CuboidStrategy` before its ``ParallelStrategy`` base: needs ``checkpointer``,
    ``broadcast``, ``model``, ``optimizers``, ``layout``, ``device_mesh``, ``lightning_module`` and ``buffers`` (a
    :class:`cuboid.parallel.BufferBroadcast`: the first data-parallel rank's buffers are saved, as DDP saves rank 0's)."""

    checkpointer: Checkpointer
    buffers: Any

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the sharded model, once setup has parallelized it

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # Cuboid restores the optimizer state itself, shard by shard

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return LiveWeights()  # the model is written shard by shard in save_checkpoint

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
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a checkpoint to ``filepath``: a local path, or a URL fsspec reaches (``s3://bucket/run/x.ckpt``;
        ``storage_options`` go to its file system, as ``trainer.save_checkpoint(..., storage_options=...)``)."""
        assert self.model is not None and self.lightning_module is not None
        replicas = getattr(self, "replicas", None)
        if replicas is not None and not replicas.writes_checkpoints:  # one replica group writes, the others skip
            return
        path, trainer = to_path(self.broadcast(str(filepath)), storage_options), self.lightning_module.trainer
        self.buffers.sync()
        saved, optimizers, degrees, mesh = self._saved_module(), self.optimizers, self.layout.degrees, self.device_mesh
        self.checkpointer.save(path, checkpoint, saved, optimizers, trainer, degrees, mesh, dp=self._data_parallel())

    def wait_for_checkpoint(self) -> None:
        """Block until a background (async) save has been written and renamed into place."""
        self.checkpointer.wait()

    @staticmethod
    def _restored(trainer: Any, lm: Any) -> set[str]:
        """The names a checkpoint about to be loaded (``fit``'s or ``validate``'s ``ckpt_path``, the main job's
        ``auto``) fills, left uninitialised. Empty without one, under ``strict_loading=False``, or unknown."""
        pending = compat.pending_checkpoint(trainer)
        if pending is None or pending is compat.UNKNOWN or not lm.strict_loading:
            return set()
        rank_zero_info(f"Cuboid: the checkpoint {pending} fills the weights: they are not initialised first")
        return restored_names(lm)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        path, strict = to_path(self.broadcast(str(checkpoint_path))), self.lightning_module.strict_loading
        if weights_only is None:  # Lightning drops the user's for a strategy that restores after setup
            weights_only = compat.requested_weights_only()
        dp, fitting = self._data_parallel(), self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []  # validate/test/predict restore the model alone, as Lightning
        return self.checkpointer.load(path, self._saved_module(), optimizers, strict, weights_only, dp)

    def _data_parallel(self) -> tuple[int, int]:
        """This rank's data-parallel rank and the degree (what the checkpointer's data position is counted over)."""
        dp = self.distributed_sampler_kwargs
        return dp["rank"], dp["num_replicas"]

    def _saved_module(self) -> Any:
        """The module whose state a checkpoint holds: the model, or under DDP the LightningModule it wraps (its
        parameters by their own names)."""
        from torch.nn.parallel import DistributedDataParallel

        return self.lightning_module if isinstance(self.model, DistributedDataParallel) else self.model

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        replicas = getattr(self, "replicas", None)
        if replicas is not None and not replicas.writes_checkpoints:
            return
        self.checkpointer.remove(to_path(str(filepath)))

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """A litdata ``StreamingDataset`` dealt over the data-parallel ranks (tp, cp and pp peers read the same
        batch); after a mid-epoch resume, the batches of the epoch that were already trained skipped; the workers
        seeded by the data-parallel rank under ``seed_everything(workers=True)``."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        dp = self.distributed_sampler_kwargs
        keep_library_batches(dataloader)  # a library's batch-yielding sampler, made again by Lightning
        layout = self.layout  # type: ignore[attr-defined]
        data_only = layout.tp * layout.cp * layout.pp == 1
        check_sampler_ranks(dataloader, dp["num_replicas"], dp["rank"], data_only, layout.describe())
        compat.deal_over_data_parallel(dataloader, dp["num_replicas"], dp["rank"])
        replicas = getattr(self, "replicas", None)
        if replicas is not None and trainer is not None and trainer.training:
            replicas.join()  # fault-tolerant replica groups: a group behind the others heals (data position too)
        return compat.seed_workers_by_data_rank(self.checkpointer.position.loader(dataloader, trainer), dp["rank"])
