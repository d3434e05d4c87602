"""Pipeline parallel: where a model is cut into stages, the schedules, and each rank's stages.

Two shapes of model qualify. An unmodified Hugging Face decoder (``AutoModelForCausalLM`` and models of its
shape): its stages run the model's own code (:mod:`cuboid.pipeline.decoder`). A model written for Cuboid's
contract: the LightningModule's model (a direct child, e.g. ``self.model``) runs ``pre -> blocks -> post``, holds
its blocks in an ``nn.ModuleDict`` keyed ``"0", "1", ...`` and skips pieces that are ``None``. Such a model may
add a loss over its blocks (Cuboid's MoE Llama: the load-balancing loss) through a method ``aux_loss()``: the sum,
over the blocks it holds, of each block's term from its last forward. Each stage then sends the sum so far beside
its output, and on the last stage the step's ``self.model.aux_loss()`` answers the microbatch's total. Either way a stage
keeps its blocks under the whole model's names and, on the first/last stage, the pieces before/after the blocks.
The step itself runs in :mod:`cuboid.pipeline.runner`.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn
from torch.distributed.pipelining import schedules as S

from cuboid.compat import shallow_module_copy
from cuboid.experts import settle_block_losses
from cuboid.pipeline import decoder

# The schedules Cuboid supports (each has a parity test); their classes come from torch's own registry.
SCHEDULES: dict[str, type] = {
    name: S.get_schedule_class(name)
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "LoopedBFS", "DualPipeV")
}
MULTI_STAGE = {name for name, cls in SCHEDULES.items() if issubclass(cls, S.PipelineScheduleMulti)}
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}  # stage 0 and the last stage on pp rank 0
ZERO_BUBBLE = {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}  # backward split into input and weight passes


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
    """Where the model is cut: ``owner`` (LightningModule attribute), its blocks (``container``, a dotted path
    relative to the owner) and the pieces before and after them (dotted paths too). ``shape`` is set for a Hugging
    Face decoder, None for a model written for Cuboid's contract."""

    owner: str
    container: str
    block_keys: list[str]
    pre: list[str]
    post: list[str]
    shape: decoder.DecoderShape | None = None
    carries_aux: bool = False  # Cuboid's contract with a loss over the blocks (``aux_loss()``) sent along the stages


def find_pipeline_split(lm: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> PipelineSplit:
    """Check that the model can be cut into stages and say what is missing when it cannot."""
    if not blocks:
        raise PipelineError(
            f"{type(lm).__name__} has no repeated blocks (a ModuleDict/ModuleList of same-class children) to split "
            "into pipeline stages. Pipeline parallelism needs a model shaped embeddings -> blocks -> head."
        )
    parts = blocks[0][0].split(".")
    if len(parts) < 3:
        raise PipelineError(
            f"pipeline parallelism needs the blocks inside the model the LightningModule holds (e.g. "
            f"'model.layers.0' or 'model.model.layers.0'); found {blocks[0][0]!r}. Set block_container or move them."
        )
    owner_name, container_name = parts[0], ".".join(parts[1:-1])
    owner = getattr(lm, owner_name)
    if any(True for _ in owner.parameters(recurse=False)):
        raise PipelineError(
            f"{owner_name} holds parameters directly; move them into a submodule so a stage can own them."
        )
    container = owner.get_submodule(container_name)
    cfg = getattr(owner, "cfg", None)  # Cuboid's Llama: an MoE whose load-balancing loss CausalLM adds
    carries_aux = bool(getattr(cfg, "n_experts", 0) and getattr(cfg, "aux_loss_coef", 0))
    if carries_aux and not callable(getattr(owner, "aux_loss", None)):
        raise PipelineError(
            f"{owner_name} adds a load-balancing loss (cfg.aux_loss_coef={cfg.aux_loss_coef}) but has no aux_loss() "
            "method summing it over the blocks it holds, which Cuboid's pipeline contract sends along the stages. "
            "Define one (see cuboid.models.Llama.aux_loss), or set aux_loss_coef=0 under pipeline parallel."
        )
    if "." not in container_name and isinstance(container, nn.ModuleDict):  # Cuboid's pipeline contract
        names = [n for n, _ in owner.named_children()]
        at = names.index(container_name)
        with_params = [
            n for n, m in owner.named_children() if any(True for _ in m.parameters()) and n != container_name
        ]
        pre = [n for n in with_params if names.index(n) < at]
        post = [n for n in with_params if names.index(n) > at]
        return PipelineSplit(owner_name, container_name, list(container.keys()), pre, post, None, carries_aux)
    try:
        shape = decoder.find_decoder_shape(owner, owner_name, container_name)
    except decoder.DecoderSplitError as err:
        if "." in container_name:
            raise PipelineError(f"{owner_name} cannot be cut into pipeline stages: {err}") from None
        raise PipelineError(
            f"{owner_name}.{container_name} is an nn.{type(container).__name__}; a model written for Cuboid's "
            "pipeline contract keeps parameter names only if its blocks live in an nn.ModuleDict keyed '0', '1', ... "
            "(iterate it with .values()) and its forward skips pieces that are None, and as a decoder of Hugging "
            f"Face's shape it does not qualify either: {err} See docs/pipeline.md."
        ) from None
    return PipelineSplit(owner_name, container_name, list(container._modules), shape.pre, shape.post, shape)


def stage_block_items(stage: nn.Module, container: str) -> list[tuple[str, nn.Module]]:
    """A stage's blocks by their keys in the whole model."""
    blocks = stage.get_submodule(container)
    if isinstance(blocks, decoder.KeyedModuleList):
        return blocks.keyed_items()
    return list(blocks.items())


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


def _forward_carrying_aux(self: nn.Module, x: torch.Tensor, *received: torch.Tensor, **kwargs: Any) -> Any:
    """A contract stage's forward for a model with a loss over its blocks: its output, and the blocks' ``aux_loss()``
    so far (what the stage before sent plus this stage's blocks' own, shaped ``(1,)``: the schedule concatenates
    each output over the microbatches)."""
    out = type(self).forward(self, x, **kwargs)
    settle_block_losses()  # its blocks' losses over the step's tokens, one sum for all (module hooks do not run here)
    own = self.aux_loss()  # this stage's view holds its own blocks only
    total = own if not received else (received[0].reshape(()) if own is None else received[0].reshape(()) + own)
    if total is None:
        total = out.new_zeros(())
    return out, total.reshape(1)


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
    if split.shape is not None:
        stage_modules = [
            decoder.build_stage(
                owner, split.shape, [keys[i] for i in blocks_per_stage[sid]], keys, sid == 0, sid == n_stages - 1
            )
            for sid in my_stages
        ]
        owned = [keys[i] for sid in my_stages for i in blocks_per_stage[sid]]
        decoder.prune(owner, split.shape, owned, 0 in my_stages, n_stages - 1 in my_stages)
        return owner, stage_modules
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
        if split.carries_aux:
            stage.forward = types.MethodType(_forward_carrying_aux, stage)
        stage_modules.append(stage)
    owned_keys = {keys[i] for sid in my_stages for i in blocks_per_stage[sid]}
    container = owner.get_submodule(split.container)
    for key in list(container.keys()):
        if key not in owned_keys:
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
