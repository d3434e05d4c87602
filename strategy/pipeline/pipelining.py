"""Pipeline parallelism for one strategy: :class:`Pipelining`, which owns the step when pp > 1.

It holds the schedule and its settings (checked when the strategy is made), this rank's stages, the
runner, and the gradients kept across Lightning's zero-grad. Lightning's automatic optimization runs
``training_step``, then (at the start of an accumulation window) ``optimizer_zero_grad``, then
``backward``. The schedule does forward and backward inside ``training_step``, so its gradients are
kept aside across Lightning's zero-grad and put back in :meth:`Pipelining.restore_grads`, which the
strategy's ``backward`` calls instead of running one; the loss is scaled by
``1 / accumulate_grad_batches`` inside the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cuboid import compat
from cuboid.parallel import ParallelSettings
from cuboid.pipeline import stages as pipeline
from cuboid.pipeline.decoder import DecoderShape
from cuboid.pipeline.runner import PipelineRunner


class Pipelining:
    """The pipeline of a CuboidStrategy (``pp`` stages; inactive when ``pp == 1``).

    Args: ``dims``, the run's degrees (``dims.pp`` stages); then as CuboidStrategy's ``pipeline_schedule``,
    ``microbatches``, ``virtual_stages``, ``pipeline_split``; ``reshard_after_forward``, the build's (its default
    resolved by :class:`~cuboid.parallel.BuildSettings`), checked against the schedule.
    """

    def __init__(
        self,
        dims: Any,
        schedule: str = "1F1B",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        split: Sequence[int] | None = None,
        reshard_after_forward: bool | int = False,  # (what a build resolves under pp > 1 unless asked otherwise)
    ) -> None:
        pp = dims.pp  # read from the run's one record of its degrees (ParallelDims, or a Layout)
        if virtual_stages is None:
            virtual_stages = 2 if schedule in pipeline.MULTI_STAGE else 1
        if microbatches is None:
            microbatches = pipeline.default_microbatches(pp, virtual_stages)
        if pp > 1:
            pipeline.check_schedule(schedule, pp, microbatches, virtual_stages)
        zero_bubble = pp > 1 and schedule in pipeline.ZERO_BUBBLE
        if zero_bubble and reshard_after_forward is not False:
            raise pipeline.PipelineError(
                f"pipeline_schedule={schedule!r} splits backward into input and weight passes, which needs "
                f"each block's parameters kept gathered between forward and backward: use reshard_after_forward=False "
                f"(or leave it None), not {reshard_after_forward!r}."
            )
        self.dims, self.schedule, self.microbatches, self.virtual_stages = dims, schedule, microbatches, virtual_stages
        self.split = list(split) if split is not None else None
        self.runner: PipelineRunner | None = None
        self._owner = ""
        self._shape: DecoderShape | None = None  # a Hugging Face decoder's cut; None for Cuboid's contract
        self._carries_aux = False  # Cuboid's contract with a loss over its blocks, sent along the stages
        self._stashed_grads: list[Tensor | None] = []
        self._tied: list[nn.Parameter] = []
        self._tied_names: list[list[str]] = []
        self._owner_module: nn.Module | None = None
        self._tied_group: Any = None
        self.counted_elsewhere: set[int] = set()  # ids of parameters the global gradient norm counts on another rank

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without what belongs to the running job: the runner (stages, schedule, their process groups)
        and the group tied weights are summed over."""
        return {**vars(self), "runner": None, "_tied_group": None}

    def tied_elsewhere(self) -> set[int]:
        """:attr:`counted_elsewhere`, asked when needed (it is known once the stages are built)."""
        return self.counted_elsewhere

    @property
    def pp(self) -> int:
        """Pipeline stages (``pp``), from the run's degrees."""
        return self.dims.pp

    @property
    def enabled(self) -> bool:
        return self.dims.pp > 1

    def describe(self) -> str:
        return f"{self.schedule} over {self.pp} stages x {self.virtual_stages}"

    def check_module(self, lm: nn.Module) -> None:
        """Refuse, before anything is built, a LightningModule the schedule cannot run: one that optimizes by hand."""
        if not getattr(lm, "automatic_optimization", True):
            raise pipeline.PipelineError(
                f"{type(lm).__name__} optimizes by hand (automatic_optimization=False), and under pipeline_parallel="
                f"{self.pp} the pipeline schedule runs every microbatch's forward and backward itself: "
                "manual_backward and the optimizer steps of a training_step have no place in it. Use "
                "pipeline_parallel=1 (data, tensor and context parallel train it as written), or let Lightning "
                "optimize (automatic_optimization=True)."
            )

    def build_stages(
        self, lm: nn.Module, blocks: list, matched: dict, settings: ParallelSettings, mesh: Any
    ) -> list[tuple[int, nn.Module]]:
        """Keep this rank's pipeline stages, then apply TP/AC/compile/FSDP2 to each stage (``settings``)."""
        split = pipeline.find_pipeline_split(lm, blocks)
        n_stages = self.pp * self.virtual_stages
        per_stage = pipeline.stage_blocks(len(split.block_keys), n_stages, self.split)
        pp_rank = mesh["pp"].get_local_rank()
        my_stages = pipeline.stage_ids(pp_rank, self.pp, self.virtual_stages, self.schedule)
        owner = getattr(lm, split.owner)
        tied = pipeline.tied_across_stages(owner, split)
        if tied and self.schedule in pipeline.V_SHAPED:
            raise pipeline.PipelineError(
                f"{split.owner}.{tied[0][0]} is tied to {split.owner}.{tied[0][-1]} (shared input and output "
                f"embeddings), and {self.schedule!r} puts the first and the last stage on one rank, where one "
                "parameter cannot belong to two stages. Use a looped schedule (1F1B, Interleaved1F1B, ...) or untie."
            )
        _, stage_modules = pipeline.build_stages(owner, split, my_stages, per_stage)
        self._tied_names, self._owner_module = tied, owner  # resolved once sharded (FSDP2 makes new parameters)

        prefix = f"{split.owner}."
        for stage in stage_modules:
            names = {n for n, _ in stage.named_modules()}
            relative = {n[len(prefix) :]: v for n, v in matched.items() if n[len(prefix) :] in names}
            stage_blocks = [
                (f"{prefix}{split.container}.{k}", b) for k, b in pipeline.stage_block_items(stage, split.container)
            ]
            settings.apply([(stage, stage_blocks)], stage, relative)
        self._owner, self._shape, self._carries_aux = split.owner, split.shape, split.carries_aux
        return list(zip(my_stages, stage_modules, strict=True))

    def build_schedule(
        self, stage_modules: list[tuple[int, nn.Module]], mesh: Any, device: torch.device, context: Any = None
    ) -> None:
        """The schedule over this rank's stages; ``context``: context parallel's runtime, which cuts each sequence
        of the schedule's inputs where cp > 1."""
        from torch.distributed.pipelining import PipelineStage

        pp_group = mesh["pp"].get_group()
        n_stages = self.pp * self.virtual_stages
        stages = [PipelineStage(module, sid, n_stages, device, group=pp_group) for sid, module in stage_modules]
        for stage in stages:  # its shape inference's forwards are not a step's (what counts a step's tokens asks)
            compat.watch_metadata_inference(stage)
        last_pp_rank = 0 if self.schedule in pipeline.V_SHAPED else self.pp - 1
        last_stage_rank = dist.get_global_rank(pp_group, last_pp_rank)
        host_group = self._host_group(mesh)
        self.runner = PipelineRunner(
            stages,
            self.schedule,
            self.microbatches,
            self._owner,
            pp_group,
            last_stage_rank,
            host_group,
            self._shape,
            self._carries_aux,
            context,
        )
        if self._tied_names:
            self._tied_group = self._first_last_group(mesh, pp_group)
            # This rank's copy of each tied parameter: its gradient is summed with the other end's after each step,
            # and the global gradient norm counts it once, on the first stage.
            held = dict(self._owner_module.named_parameters())
            self._tied = [held[n] for names in self._tied_names for n in names if n in held]
            # (By identity: attributes set on a DTensor parameter are lost when nn.Module._apply swaps its contents.)
            self.counted_elsewhere = {
                id(held[n]) for names in self._tied_names if names[0] not in held for n in names[1:] if n in held
            }

    def _host_group(self, mesh: Any) -> Any:
        """A gloo group over this rank's pp group (the pp group itself when it is gloo), made on every rank: what a
        pipelined step tells every stage about its logs goes through host memory, never a device read."""
        pp_group = mesh["pp"].get_group()
        if dist.get_backend(pp_group) == "gloo":
            return pp_group
        return self._group_per_column(mesh, lambda column: column, backend="gloo")

    def _first_last_group(self, mesh: Any, pp_group: Any) -> Any:
        """The process group of this rank's first and last pp ranks (same dp/tp coordinates); made on every rank."""
        if self.pp == 2:
            return pp_group
        return self._group_per_column(mesh, lambda column: [column[0], column[-1]])

    def _group_per_column(self, mesh: Any, members: Any, backend: str | None = None) -> Any:
        """One new group per pp column of the mesh (the ranks sharing dp/tp coordinates), of ``members(column)``;
        every rank makes every group (``new_group`` is collective) and gets back the one it belongs to."""
        ranks = mesh.mesh.reshape(self.pp, -1)
        mine = None
        for column in range(ranks.shape[1]):
            chosen = [int(r) for r in members(list(ranks[:, column]))]
            group = dist.new_group(chosen, backend=backend)
            if dist.get_rank() in chosen:
                mine = group
        return mine

    def _sum_tied_grads(self) -> None:
        for param in self._tied:
            if param.grad is not None:
                grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                dist.all_reduce(grad, group=self._tied_group)

    def training_step(self, lm: Any, batch: Any, batch_idx: int, precision: Any, device: torch.device) -> Tensor:
        """Forward and backward of every microbatch; returns the microbatch-mean loss, the same on every rank."""
        assert self.runner is not None
        accumulate = lm.trainer.accumulate_grad_batches
        params = list(lm.parameters())
        first_of_window = batch_idx % accumulate == 0
        previous = [None if first_of_window else p.grad for p in params]
        for p in params:
            p.grad = None
        with precision.train_step_context():
            loss = self.runner.run(lm, "training_step", batch, batch_idx, True, 1 / accumulate)
        self._sum_tied_grads()
        # Lightning zeroes gradients *after* training_step (at a window start) and then calls backward:
        # keep the schedule's gradients aside until restore_grads() puts them back.
        self._stashed_grads = [
            g if prev is None else (prev if g is None else g + prev)
            for g, prev in zip((p.grad for p in params), previous, strict=True)
        ]
        for p in params:
            p.grad = None
        return torch.full((), float("nan"), device=device) if loss is None else loss

    def restore_grads(self, lm: nn.Module) -> None:
        """Put back the gradients the last training_step's schedule computed (instead of a backward)."""
        for p, g in zip(lm.parameters(), self._stashed_grads, strict=True):
            p.grad = g
        self._stashed_grads = []

    def eval_step(self, lm: Any, hook: str, batch: Any, batch_idx: int, precision: Any, device: torch.device) -> Any:
        """A forward-only schedule of ``lm.<hook>`` (validation_step, test_step: their mean loss; predict_step: what
        it returns on the last stage, its microbatches' outputs joined into the batch's, on every rank of the pp
        group, each of which holds the batch, as under pp1)."""
        assert self.runner is not None
        predict = hook == "predict_step"
        if predict and self.runner.context is not None:
            raise pipeline.PipelineError(
                "trainer.predict with pipeline_parallel and context_parallel is not supported: each cp rank's last "
                "stage holds only its share of every sequence. Predict with context_parallel=1 (a checkpoint loads "
                "into any layout)."
            )
        context = precision.predict_step_context() if predict else precision.val_step_context()
        with torch.no_grad(), context:
            return self.runner.run(lm, hook, batch, batch_idx, False, outputs=predict)

    def check_loader(self, loader: Any) -> None:
        """Refuse, before the first step, batches (the epoch's last included) the microbatches cannot split."""
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


def batch_and_index(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """The batch and batch_idx of a Lightning step hook's arguments."""
    batch = args[0] if args else kwargs["batch"]
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    return batch, batch_idx
