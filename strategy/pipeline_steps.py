"""The Lightning side of pipeline parallelism: the strategy owns the step when pp > 1.

Mixed into :class:`~cuboid.CuboidStrategy`. Lightning's automatic optimization runs
``training_step``, then (at the start of an accumulation window) ``optimizer_zero_grad``, then
``backward``. The schedule does forward and backward inside ``training_step``, so its gradients
are kept aside across Lightning's zero-grad and put back in :meth:`backward`, which otherwise
does nothing; the loss is scaled by ``1 / accumulate_grad_batches`` inside the schedule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from cuboid import pipeline
from cuboid.parallelize import parallelize
from cuboid.plans import parallel_plan

if TYPE_CHECKING:
    import lightning.pytorch as pl


class PipelineStepsMixin:
    """Pipelined ``training_step``/``validation_step``/``test_step`` and the stage setup."""

    _pipeline: pipeline.PipelineRunner | None
    _pipeline_owner: str
    _stashed_grads: list[Tensor | None]

    def _split_pipeline(
        self, lm: pl.LightningModule, blocks: list, matched: dict, common: dict[str, Any]
    ) -> list[tuple[int, nn.Module]]:
        """Keep this rank's pipeline stages, then apply TP/AC/compile/FSDP2 to each stage."""
        split = pipeline.find_pipeline_split(lm, blocks)
        n_stages = self.layout.pp * self.virtual_stages
        per_stage = pipeline.stage_blocks(len(split.block_keys), n_stages, self.pipeline_split)
        pp_rank = self.device_mesh["pp"].get_local_rank()
        my_stages = pipeline.stage_ids(pp_rank, self.layout.pp, self.virtual_stages, self.pipeline_schedule)
        owner = getattr(lm, split.owner)
        _, stage_modules = pipeline.build_stages(owner, split, my_stages, per_stage)
        prefix = f"{split.owner}."
        for stage in stage_modules:
            names = {n for n, _ in stage.named_modules()}
            relative = {n[len(prefix) :]: v for n, v in matched.items() if n[len(prefix) :] in names}
            stage_blocks = [
                (f"{prefix}{split.container}.{k}", b) for k, b in stage.get_submodule(split.container).items()
            ]
            parallelize([(stage, stage_blocks)], tp_root=stage, tp_plan=parallel_plan(relative), **common)
        self._pipeline_owner = split.owner
        return list(zip(my_stages, stage_modules, strict=True))

    def _build_schedule(self, stage_modules: list[tuple[int, nn.Module]]) -> None:
        from torch.distributed.pipelining import PipelineStage

        pp_mesh = self.device_mesh["pp"]
        n_stages = self.layout.pp * self.virtual_stages
        stages = [
            PipelineStage(module, sid, n_stages, self.root_device, group=pp_mesh.get_group())
            for sid, module in stage_modules
        ]
        last_pp_rank = 0 if self.pipeline_schedule in pipeline.V_SHAPED else self.layout.pp - 1
        self._pipeline = pipeline.PipelineRunner(
            stages,
            self.pipeline_schedule,
            self.microbatches,
            self._pipeline_owner,
            pp_mesh.get_group(),
            dist.get_global_rank(pp_mesh.get_group(), last_pp_rank),
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp > 1 the strategy owns the step: the schedule runs forward and backward of every
        microbatch; the loss returned (the microbatch mean) is the same on every rank."""
        if self.layout.pp == 1:
            return super().training_step(*args, **kwargs)
        trainer = self.lightning_module.trainer
        batch, batch_idx = self._batch_and_index(args, kwargs)
        accumulate = trainer.accumulate_grad_batches
        params = [p for p in self.lightning_module.parameters()]
        first_of_window = batch_idx % accumulate == 0
        previous = [None if first_of_window else p.grad for p in params]
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._pipeline.run(self.lightning_module, "training_step", batch, batch_idx, True, 1 / accumulate)
        # Lightning zeroes gradients *after* training_step (at a window start) and then calls backward:
        # keep the schedule's gradients aside until backward() puts them back.
        self._stashed_grads = [
            g if prev is None else (prev if g is None else g + prev)
            for g, prev in zip((p.grad for p in params), previous, strict=True)
        ]
        for p in params:
            p.grad = None
        self._after_pipelined_step()
        return torch.tensor(float("nan") if loss is None else loss, device=self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.layout.pp == 1:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        params = list(self.lightning_module.parameters())
        for p, g in zip(params, self._stashed_grads, strict=True):
            p.grad = g
        self._stashed_grads = []
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.layout.pp > 1:
            raise NotImplementedError(
                "trainer.predict is not supported with pipeline_parallel > 1: predictions live on the last stage. "
                "Run predict with pipeline_parallel=1 (a checkpoint loads into any layout)."
            )
        return super().predict_step(*args, **kwargs)

    def _eval_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        if self.layout.pp == 1:
            return getattr(super(), hook)(*args, **kwargs)
        batch, batch_idx = self._batch_and_index(args, kwargs)
        with torch.no_grad(), self.precision_plugin.val_step_context():
            loss = self._pipeline.run(self.lightning_module, hook, batch, batch_idx, False)
        self._after_pipelined_step()
        return None if loss is None else torch.tensor(loss, device=self.root_device)

    def _after_pipelined_step(self) -> None:
        pipeline.sync_metric_states(self.lightning_module, self._pipeline.last_stage_rank, self._pipeline.pp_group)

    @staticmethod
    def _batch_and_index(args: tuple, kwargs: dict) -> tuple[Any, int]:
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        return batch, batch_idx

    @override
    def on_train_start(self) -> None:
        """Refuse, before the first step, an epoch whose last batch the microbatches cannot split."""
        if self.layout.pp == 1:
            return
        loader = self.lightning_module.trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None)
        if not batch_size or getattr(loader, "drop_last", False):
            return
        samples = len(loader.sampler) if hasattr(loader, "sampler") else None
        if samples and samples % batch_size and (samples % batch_size) % self.microbatches:
            raise pipeline.PipelineError(
                f"the last batch of each epoch holds {samples % batch_size} samples ({samples} per rank, batch size "
                f"{batch_size}), not divisible by microbatches={self.microbatches}. Use DataLoader(drop_last=True), "
                f"or a dataset size per rank that is a multiple of the batch size."
            )
        if batch_size % self.microbatches:
            raise pipeline.PipelineError(
                f"batch size {batch_size} is not divisible by microbatches={self.microbatches}; use a multiple of "
                f"{self.microbatches}."
            )
