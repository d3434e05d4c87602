"""Pipeline parallel: split a pipeline-ready model into stages, and run Lightning's step through a schedule.

Pipeline-ready: the LightningModule's model (a direct child, e.g. ``self.model``)
runs ``pre -> blocks -> post``, holds its blocks in an ``nn.ModuleDict`` keyed ``"0", "1", ...``
and skips pieces that are ``None``. A stage keeps its blocks (same keys, so parameter names are
those of the whole model) and, on the first/last stage, the pieces before/after the blocks.

The step: the user's own ``training_step`` runs unchanged. On the first stage Cuboid calls it with
a stand-in model that records the input and stops; on the last stage the schedule's loss function
calls it once per microbatch with a stand-in that returns the stage's output. What it logs is
averaged over microbatches and replayed on every rank (so ``sync_dist`` collectives match), and
the loss returned to Lightning is the microbatch mean, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from cuboid.compat import is_view_of, shallow_module_copy
from cuboid.pipeline.results import LogRecorder, ResultExchange, StepResults

# The schedules Cuboid supports (each has a parity test); their classes come from torch's own registry.
SCHEDULES: dict[str, type] = {
    name: S.get_schedule_class(name)
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "LoopedBFS")
}
MULTI_STAGE = {name for name, cls in SCHEDULES.items() if issubclass(cls, S.PipelineScheduleMulti)}
V_SHAPED = {"ZBVZeroBubble"}  # stage 0 and the last stage on pp rank 0
ZERO_BUBBLE = {"InterleavedZeroBubble", "ZBVZeroBubble"}  # backward split into input and weight passes


class PipelineError(ValueError):
    """A model, batch or schedule that cannot be pipelined as asked; the message says what to change."""


def default_microbatches(pp: int, virtual_stages: int) -> int:
    """Micro-batches per step when none are given: two per stage (``2 x pp x virtual_stages``), 1 without pp."""
    return 2 * pp * virtual_stages if pp > 1 else 1


def check_schedule(name: str, pp: int, microbatches: int, virtual: int) -> None:
    if name not in SCHEDULES:
        raise PipelineError(f"pipeline_schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}.")
    if name in V_SHAPED and virtual != 2:
        raise PipelineError(
            f"{name} is V-shaped: it needs exactly 2 stages per rank (virtual_stages=2), got {virtual}."
        )
    if name not in MULTI_STAGE and virtual != 1:
        raise PipelineError(f"{name} runs one stage per rank; virtual_stages={virtual} needs an interleaved schedule.")
    if name != "GPipe" and microbatches < pp:
        raise PipelineError(
            f"{name} needs at least as many microbatches as pipeline stages: microbatches={microbatches} < "
            f"pipeline_parallel={pp}. Use microbatches>={pp} (more shrinks the bubble), or pipeline_schedule='GPipe'."
        )


@dataclass
class PipelineSplit:
    """Where the model is cut: ``owner`` (LightningModule attribute), its blocks and outer pieces."""

    owner: str
    container: str
    block_keys: list[str]
    pre: list[str]
    post: list[str]


def find_pipeline_split(lm: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> PipelineSplit:
    """Check that the model is pipeline-ready and say what is missing when it is not."""
    if not blocks:
        raise PipelineError(
            f"{type(lm).__name__} has no repeated blocks (a ModuleDict/ModuleList of same-class children) to split "
            "into pipeline stages. Pipeline parallelism needs a model shaped pre -> blocks -> post."
        )
    parts = blocks[0][0].split(".")
    if len(parts) != 3:
        raise PipelineError(
            f"pipeline parallelism needs the blocks as a child of the LightningModule's model (e.g. "
            f"'model.layers.0'); found {blocks[0][0]!r}. Set block_container or restructure the model."
        )
    owner_name, container_name = parts[0], parts[1]
    owner = getattr(lm, owner_name)
    container = getattr(owner, container_name)
    if not isinstance(container, nn.ModuleDict):
        raise PipelineError(
            f"{owner_name}.{container_name} is an nn.{type(container).__name__}; pipeline stages keep parameter "
            f"names only if the blocks live in an nn.ModuleDict keyed '0', '1', ... (iterate it with .values()). "
            f"Change the model to use nn.ModuleDict."
        )
    names = [n for n, _ in owner.named_children()]
    at = names.index(container_name)
    with_params = [n for n, m in owner.named_children() if any(True for _ in m.parameters()) and n != container_name]
    pre = [n for n in with_params if names.index(n) < at]
    post = [n for n in with_params if names.index(n) > at]
    if any(True for _ in owner.parameters(recurse=False)):
        raise PipelineError(
            f"{owner_name} holds parameters directly; move them into a submodule so a stage can own them."
        )
    return PipelineSplit(owner_name, container_name, list(container.keys()), pre, post)


def tied_across_stages(owner: nn.Module, split: PipelineSplit) -> list[list[str]]:
    """Groups of names (relative to ``owner``) of one parameter shared by a piece before the blocks and one after
    (tied input and output embeddings): the first and last stages each hold a copy."""
    groups: dict[int, list[str]] = {}
    for name, param in owner.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    pre, post = tuple(f"{n}." for n in split.pre), tuple(f"{n}." for n in split.post)
    return [
        names
        for names in groups.values()
        if any(n.startswith(pre) for n in names) and any(n.startswith(post) for n in names)
    ]


def stage_blocks(n_blocks: int, n_stages: int, split: Sequence[int] | None) -> list[list[int]]:
    """Block indices per stage: an even split, or ``split`` (blocks per stage)."""
    if split is None:
        if n_blocks % n_stages:
            raise PipelineError(
                f"the model has {n_blocks} blocks, not divisible by {n_stages} pipeline stages. Pass "
                f"pipeline_split=[...] (blocks per stage, {n_stages} numbers summing to {n_blocks}) or change "
                f"pipeline_parallel / virtual_stages."
            )
        split = [n_blocks // n_stages] * n_stages
    if len(split) != n_stages or sum(split) != n_blocks or min(split) < 0:
        raise PipelineError(
            f"pipeline_split={list(split)} must have {n_stages} non-negative numbers (one per stage) summing to "
            f"the {n_blocks} blocks of the model."
        )
    bounds = [sum(split[:i]) for i in range(n_stages + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n_stages)]


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stages this pp rank runs: looped (r, r+P, ...) or, for V schedules, (r, 2P-1-r)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def build_stages(
    owner: nn.Module, split: PipelineSplit, my_stages: list[int], blocks_per_stage: list[list[int]]
) -> tuple[nn.Module, list[nn.Module]]:
    """Prune ``owner`` to this rank's stages.

    Returns the *union* (the original module holding every block and piece this rank owns, which
    replaces the LightningModule's model so ``parameters()`` and ``state_dict()`` see this rank's
    share under the original names) and one stage module per stage (shallow views into it).
    """
    n_stages = len(blocks_per_stage)
    keys = split.block_keys
    stage_modules = []
    for sid in my_stages:
        stage = shallow_module_copy(owner)
        blocks = owner.get_submodule(split.container)
        setattr(stage, split.container, nn.ModuleDict({keys[i]: blocks[keys[i]] for i in blocks_per_stage[sid]}))
        for name in split.pre:
            if sid != 0:
                setattr(stage, name, None)
        for name in split.post:
            if sid != n_stages - 1:
                setattr(stage, name, None)
        stage_modules.append(stage)
    owned = {keys[i] for sid in my_stages for i in blocks_per_stage[sid]}
    container = owner.get_submodule(split.container)
    for key in list(container.keys()):
        if key not in owned:
            del container[key]
    if 0 not in my_stages:
        for name in split.pre:
            setattr(owner, name, None)
    if n_stages - 1 not in my_stages:
        for name in split.post:
            setattr(owner, name, None)
    return owner, stage_modules


def split_batch(batch: Any, microbatches: int) -> list[Any]:
    """Cut every tensor of the batch into ``microbatches`` equal pieces along dim 0."""
    sizes = set()
    apply_to_collection(batch, torch.Tensor, lambda t: sizes.add(t.shape[0]))
    if len(sizes) != 1:
        raise PipelineError(f"the batch's tensors disagree on their batch size (dim 0): {sorted(sizes)}.")
    (size,) = sizes
    if size % microbatches:
        raise PipelineError(
            f"batch size {size} is not divisible by microbatches={microbatches}: the pipeline would give one "
            f"rank silently different gradients. Use a batch size that is a multiple of {microbatches} and "
            f"DataLoader(drop_last=True) so the last batch of an epoch is full, or change microbatches."
        )
    out = []
    for i in range(microbatches):
        out.append(apply_to_collection(batch, torch.Tensor, lambda t, i=i: t.tensor_split(microbatches)[i]))
    return out


class _Captured(Exception):  # noqa: N818  (control flow, not an error)
    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args_, self.kwargs_ = args, kwargs


class _StandIn(nn.Module):
    """Takes the model's place during a pipelined step; other attributes come from the real model."""

    def __init__(self, real: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)


class _CaptureInput(_StandIn):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)


class _StageOutput(_StandIn):
    def __init__(self, real: nn.Module, output: Any) -> None:
        super().__init__(real)
        object.__setattr__(self, "_output", output)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return object.__getattribute__(self, "_output")


def _zero_loss(output: Any) -> torch.Tensor:
    """0 times the sum of the output's floating tensors: a loss on the output's graph (every input gets a
    gradient's metadata) that touches no user code."""
    parts = []
    apply_to_collection(
        output, torch.Tensor, lambda t: parts.append(t.float().sum()) if t.is_floating_point() else None
    )
    return torch.stack(parts).sum() * 0.0


class PipelineRunner:
    """Runs a LightningModule step through a ``torch.distributed.pipelining`` schedule."""

    def __init__(
        self,
        stages: list[PipelineStage],
        schedule_name: str,
        microbatches: int,
        owner_name: str,
        pp_group: dist.ProcessGroup,
        last_stage_rank: int,
        host_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.stages, self.microbatches, self.owner_name = stages, microbatches, owner_name
        self.pp_group, self.last_stage_rank = pp_group, last_stage_rank
        self.host_group = host_group if host_group is not None else pp_group
        self.results = ResultExchange(pp_group, self.host_group, last_stage_rank, stages[0].device)
        cls = SCHEDULES[schedule_name]
        target = stages if schedule_name in MULTI_STAGE else stages[0]
        self.schedule = cls(target, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=True)
        self._step_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
        self.has_first = any(s.is_first for s in stages)
        self._checked: set[str] = set()  # hooks whose first step checked that the model is called as it must be
        self.has_last = any(s.is_last for s in stages)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        assert self._step_loss is not None
        return self._step_loss(output, target)

    def run(
        self, lm: Any, hook: str, batch: Any, batch_idx: int, train: bool, loss_scale: float = 1.0
    ) -> torch.Tensor | None:
        """One pipelined step of ``lm.<hook>``; returns the microbatch-mean loss as a device tensor, the same on every
        rank of the pp group (None if the hook returns none). Reads nothing from the device."""
        mbs = split_batch(batch, self.microbatches)
        user_step = getattr(lm, hook)
        results = StepResults()  # per microbatch index: its loss and log calls

        real = getattr(lm, self.owner_name)

        def call_user(mb: Any, standin: nn.Module, recorder: LogRecorder) -> Any:
            setattr(lm, self.owner_name, standin)
            lm.__dict__["log"], lm.__dict__["log_dict"] = recorder.log, recorder.log_dict
            try:
                return user_step(mb, batch_idx)
            finally:
                setattr(lm, self.owner_name, real)
                del lm.__dict__["log"], lm.__dict__["log_dict"]

        def step_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            if not is_view_of(target, targets):
                # The schedule's metadata inference (first step), on uninitialized inputs: the user's step must not
                # run (its metrics would count a garbage microbatch); a zero loss on the output's graph will do.
                return _zero_loss(output)
            recorder = LogRecorder(lm)
            index = target.tolist()[0]  # a host tensor (the microbatch's index): no device read
            out = call_user(mbs[index], _StageOutput(real, output), recorder)
            loss = out["loss"] if isinstance(out, dict) else out
            results.calls[index] = recorder.calls
            if loss is None:
                results.losses[index] = None
                return torch.zeros((), device=output.device, requires_grad=train)
            results.losses[index] = loss.detach()
            return loss * loss_scale

        inputs: tuple = ()
        problem: str | None = None
        if self.has_first:
            try:
                inputs = self._capture_input(call_user, batch, hook, real, lm)
            except PipelineError as err:
                problem = str(err)
        if hook not in self._checked:
            # Every stage must stop, not only the first (the others would wait forever). Checked on the first step
            # of each hook only: how a step calls the model does not change, and the check is an object collective.
            box_problem = [problem]
            dist.broadcast_object_list(box_problem, src=dist.get_global_rank(self.pp_group, 0), group=self.host_group)
            if box_problem[0] is not None:
                raise PipelineError(box_problem[0])
            self._checked.add(hook)
        elif problem is not None:
            raise PipelineError(problem)
        counts_before = self.results.update_counts(lm) if self.has_last else None
        self._step_loss = step_loss
        targets = torch.arange(self.microbatches) if self.has_last else None
        run = self.schedule.step if train else self.schedule.eval
        try:
            run(*inputs, target=targets)
        finally:
            self._step_loss = None
        return self.results.exchange(lm, results if self.has_last else None, counts_before)

    def _capture_input(self, call_user: Callable, batch: Any, hook: str, real: nn.Module, lm: Any) -> tuple:
        try:
            call_user(batch, _CaptureInput(real), LogRecorder(lm))
        except _Captured as captured:
            if captured.kwargs_:
                raise PipelineError(
                    f"{hook} calls self.{self.owner_name}(...) with keyword arguments; under pipeline parallelism "
                    "the model takes positional tensors only."
                ) from None
            return captured.args_
        raise PipelineError(
            f"{hook} never calls self.{self.owner_name}(...), so Cuboid cannot find the pipeline's input. Under "
            f"pipeline parallelism the step must call the model once, e.g. `out = self.{self.owner_name}(x)`."
        )
