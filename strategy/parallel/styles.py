"""Tensor-parallel style names, and the DTensor ``ParallelStyle`` each one becomes.

A plan maps module-name globs to style strings. Cuboid's own names and Hugging Face's (4.x and
5.x, read from ``transformers.distributed.tensor_parallel``, where each name is registered with
its layouts) are accepted; each maps onto torch's DTensor styles with transformers' semantics:

:data:`STYLES` says what each one does (and :data:`ALIASES`, which names map onto it). ``colwise`` and ``rowwise``
also take a layer whose weight is stored transposed, ``(in, out)``: transformers' ``Conv1D`` (GPT-2 and its kin
compute ``x @ weight + bias``), which torch's styles refuse; there they shard the other weight dimension, and the
layer's own forward runs on DTensors, whose sharding rules give each rank its share.

Mixture-of-experts and fused-expert styles (``moe_tp_experts``, ``moe_identity_expert``,
``packed_colwise``, ``packed_rowwise``, ``ep_*``) are refused with a message in a user's
plan: Cuboid does not split experts over tp (a model's own plan loses those entries, see
:func:`cuboid.parallel.plans.usable_model_plan`; ``expert_parallel`` splits experts over other ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from cuboid.compat import swap_parameter

STYLES: dict[str, str] = {
    "colwise": "shard the output features (Linear weight dim 0, Conv1D's dim 1); output stays sharded",
    "rowwise": "shard the input features (Linear weight dim 1, Conv1D's dim 0); input sharded, output all-reduced",
    "rowwise_split_input": "shard the input features of a replicated input (split locally); output all-reduced",
    "output": "shard the output features and all-gather the result (replicated output)",
    "embedding": "shard the vocabulary of an nn.Embedding; output summed over tp (replicated)",
    "embedding_colwise": "shard the hidden dim of an nn.Embedding; output all-gathered (replicated)",
    "sequence_parallel": "shard activations along the sequence dim around norms (weights replicated)",
    "embedding_sequence": "shard the vocabulary of an nn.Embedding; output reduce-scattered along the sequence",
    "rowwise_sequence": "shard the input features; output reduce-scattered along the sequence (dim 1)",
    "gather_sequence": "all-gather the module's sequence-sharded first input before it runs",
    "replicated_sequence": "run the module whole on the gathered sequence (local tensors), output split back",
    "loss_parallel": "shard the output features; logits stay vocabulary-sharded for a loss-parallel cross-entropy",
    "replicated_with_grad_allreduce": "weights replicated, gradients summed over tp (per-head norms)",
    "all_reduce": "all-reduce the module's partial output",
    "local_params": "run the module with its own tp-sharded parameters as local tensors",
    "replicate": "leave the module replicated on every tp rank (nothing to do)",
    "local_heads": "an attention module whose projections are split: its head-count attributes this rank's",
    "sequence_local": "a module whole on every tp rank on a sequence-sharded local input, gradients summed over tp",
    "local_input": "run the module on its first input as a local tensor, a DTensor input made whole first",
    "mla_kv_a_proj": "MLA's K/V down-projection: weight replicated, its output's rotary slice's gradient summed over tp",
}
ALIASES: dict[str, str] = {
    "colwise_rep": "output",
    "colwise_gather_output": "output",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "embedding",
    "sequence_parallel_output": "sequence_parallel",
    # transformers 5.25: head-aligned colwise / rowwise for attention projections, which replicate heads when a
    # model has fewer than tp. Cuboid asks tp to divide every head count (plans.check_tp_divisibility), and with
    # whole heads on every rank they are colwise and rowwise.
    "unit_colwise": "colwise",
    "unit_rowwise": "rowwise",
}
# Styles that shard experts of a mixture-of-experts layer (or fused expert weights): not supported.
_EXPERT_STYLES = ("moe_tp_experts", "moe_identity_expert", "packed_colwise", "packed_rowwise")


class PlanError(ValueError):
    """A plan that does not fit the model or the layout; the message says what to change."""


def check_plan_styles(plan: Mapping[str, str] | None) -> None:
    """Every style of a user's ``tensor_parallel_plan`` known (:func:`canonical_style`), checked when the strategy is
    made, before any process starts."""
    for pattern, style in (plan or {}).items():
        canonical_style(style, pattern)


def canonical_style(style: str, pattern: str = "") -> str:
    """The canonical name of ``style`` (aliases resolved), or :class:`PlanError` naming the style and module."""
    if not isinstance(style, str):
        raise PlanError(f"Tensor-parallel style for {pattern!r} must be a string, got {style!r}.")
    name = ALIASES.get(style, style)
    if name in STYLES:
        return name
    if style in _EXPERT_STYLES or style.startswith(("moe_", "ep_", "grouped_")):
        raise PlanError(
            f"Tensor-parallel style {style!r} on {pattern!r} shards mixture-of-experts (or fused expert) weights, "
            "which Cuboid does not support. Leave those modules out of the plan (pass tensor_parallel_plan= without "
            "the expert entries: the experts then stay replicated over tp and sharded by FSDP), or use "
            "tensor_parallel=1."
        )
    valid = ", ".join(f"'{s}'" for s in STYLES)
    raise PlanError(
        f"Unknown tensor-parallel style {style!r} for {pattern!r}. Valid styles: {valid} "
        f"(aliases: {', '.join(sorted(ALIASES))})."
    )


def to_parallel_style(style: str, rope_dim: int | None = None) -> ParallelStyle | None:
    """Turn a style string into a DTensor ``ParallelStyle`` (``None`` for ``"replicate"``: nothing to apply).
    ``rope_dim``: for ``"mla_kv_a_proj"``, the model's ``qk_rope_head_dim``."""
    name = canonical_style(style)
    if name == "mla_kv_a_proj":
        if rope_dim is None:
            raise PlanError("'mla_kv_a_proj' needs the model's qk_rope_head_dim (the rotary features it outputs).")
        return MlaKvAProj(rope_dim)
    if name == "colwise":
        return _Colwise()
    if name == "rowwise":
        return _Rowwise()
    if name == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "output":
        return GatheredInputColwise(output_layouts=Replicate())
    if name == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "sequence_parallel":
        return SequenceParallel()
    if name == "embedding_sequence":
        return _SequenceShardedEmbedding()
    if name == "rowwise_sequence":
        return RowwiseParallel(output_layouts=Shard(1))
    if name == "gather_sequence":
        return _GatherSequence()
    if name == "replicated_sequence":
        return _ReplicatedSequence()
    if name == "loss_parallel":
        return GatheredInputColwise(output_layouts=Shard(-1), use_local_output=False)
    if name == "replicated_with_grad_allreduce":
        return LocalParams(replicate_plain=True, grad_placements=[Partial()])
    if name == "all_reduce":
        return PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate())
    if name == "local_params":
        return LocalParams(replicate_plain=False, grad_placements=None)
    if name == "local_input":
        return _LocalInput()
    if name == "sequence_local":
        return SequenceParallel(use_local_output=True)
    if name == "local_heads":
        from cuboid.parallel.derived import LocalHeads

        return LocalHeads()
    return None  # "replicate"


def sharded_size(module: nn.Module, style: str) -> tuple[int, str] | None:
    """The size a style splits over tp, and what it is, for the divisibility check (``None``: nothing split)."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    if is_transposed_linear(module) and style in ("colwise", "rowwise"):  # (in, out): GPT-2's Conv1D
        return (weight.shape[1], "output features") if style == "colwise" else (weight.shape[0], "input features")
    if style in ("colwise", "output", "loss_parallel"):
        if isinstance(module, nn.Embedding):
            return weight.shape[1], "embedding dim"
        return weight.shape[0], "output features"
    if style in ("rowwise", "rowwise_split_input", "rowwise_sequence"):
        if isinstance(module, nn.Embedding):
            return weight.shape[0], "embeddings (vocabulary rows)"
        return weight.shape[1], "input features"
    if style in ("embedding", "embedding_sequence"):
        return weight.shape[0], "embeddings (vocabulary rows)"
    if style == "embedding_colwise":
        return weight.shape[1], "embedding dim"
    return None


def is_transposed_linear(module: nn.Module) -> bool:
    """A linear map whose weight is stored ``(in, out)``: transformers' ``Conv1D`` (``nx`` inputs, ``nf`` outputs)."""
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and tuple(weight.shape) == (nx, nf)
    )


def distribute_transposed(module: nn.Module, mesh: DeviceMesh, colwise: bool) -> nn.Module:
    """Shard a transposed linear layer over ``mesh`` (1-D, tp): ``colwise``, its output features (weight dim 1 and
    the bias), taking a replicated input and giving its share of the output; else its input features (weight dim
    0; the bias whole), taking that share of the input and giving the whole output."""
    placements = {"weight": Shard(1), "bias": Shard(0)} if colwise else {"weight": Shard(0), "bias": Replicate()}
    taken: Placement = Replicate() if colwise else Shard(-1)
    given: Placement = Shard(-1) if colwise else Replicate()

    def partition(name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        if mod is not module:
            return
        for key, param in list(mod.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [placements.get(key, Replicate())])
            mod.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def inputs(mod: nn.Module, args: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(_as_dtensor(a, device_mesh, taken) for a in args)

    def outputs(mod: nn.Module, out: Any, device_mesh: DeviceMesh) -> Tensor:
        return out.redistribute(device_mesh, [given]).to_local()

    return distribute_module(module, mesh, partition, inputs, outputs)


def _as_dtensor(value: Any, mesh: DeviceMesh, placement: Placement) -> Any:
    if isinstance(value, DTensor):
        return value.redistribute(mesh, [placement])
    if isinstance(value, Tensor):
        return DTensor.from_local(value, mesh, [placement], run_check=False)
    return value


class _Colwise(ColwiseParallel):
    """torch's ColwiseParallel, which also takes a layer whose weight is stored transposed (GPT-2's Conv1D)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if is_transposed_linear(module):
            return distribute_transposed(module, device_mesh, colwise=True)
        return super()._apply(module, device_mesh)


class _Rowwise(RowwiseParallel):
    """torch's RowwiseParallel, which also takes a layer whose weight is stored transposed (GPT-2's Conv1D)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if is_transposed_linear(module):
            return distribute_transposed(module, device_mesh, colwise=False)
        return super()._apply(module, device_mesh)


class LocalParams(ParallelStyle):
    """Run a module's forward with its own DTensor parameters as local tensors.

    ``replicate_plain``: first make its plain parameters replicated DTensors on the tp mesh (so FSDP2
    shards them as 2-D DTensors and the gradient placement is tracked). ``grad_placements``: how the
    gradient of the local tensor is read (``[Partial()]``: each rank holds a partial sum, which the
    redistribute to the parameter's ``Replicate`` placement all-reduces; ``None``: as the parameter's
    own placement). This is what transformers' ``replicated_with_grad_allreduce`` and ``local_params``
    do, expressed in DTensor terms so that it composes with FSDP2 and checkpoints.
    """

    def __init__(self, replicate_plain: bool, grad_placements: list[Any] | None) -> None:
        super().__init__()
        self.replicate_plain = replicate_plain
        self.grad_placements = grad_placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.replicate_plain:
            for name, param in list(module.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
                    module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        originals: dict[str, nn.Parameter] = {}
        grad_placements = self.grad_placements

        def to_local(mod: nn.Module, args: Any) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    originals[name] = param
                    swap_parameter(mod, name, param.to_local(grad_placements=grad_placements))

        def restore(mod: nn.Module, args: Any, output: Any) -> Any:
            for name, param in originals.items():
                swap_parameter(mod, name, param)
            originals.clear()
            return output

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore)
        return module


class MlaKvAProj(ParallelStyle):
    """Multi-head latent attention's joint K/V down-projection (transformers' ``mla_kv_a_proj``, DeepSeek V2/V3).

    Its output is ``[compressed K/V, rotary key]``. The compressed part goes through ``kv_b_proj`` (colwise),
    whose input gradient tp already sums; the rotary key (``rope_dim`` features) goes straight to attention, where
    it is shared by this rank's heads only, so its gradient is a partial sum over tp: summed in backward (forward
    unchanged). The weight stays replicated, as the norms do, and gets the same gradient on every tp rank."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim

        def sum_rotary_grad(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            compressed, rotary = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
            whole = DTensor.from_local(rotary, device_mesh, [Replicate()], run_check=False)
            return torch.cat([compressed, whole.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(sum_rotary_grad)
        return module


class GatheredInputColwise(ColwiseParallel):
    """``ColwiseParallel`` that first gathers an input arriving as a DTensor sharded another way (the ``Shard(1)``
    output of a sequence-parallel norm before the output projection) to ``Replicate``.

    Torch's ``ColwiseParallel`` redistributes an input only when its ``input_layouts`` differ from ``Replicate``:
    a sequence-sharded DTensor reached ``F.linear`` as it was, and backward moved ``b s h`` twice more per
    micro-batch (the ledger saw it). Gathered here, backward reduce-scatters the input gradient once."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            first, *rest = args
            if isinstance(first, DTensor) and not all(p.is_replicate() for p in first.placements):
                first = first.redistribute(device_mesh, [Replicate()])
            return (first, *rest), kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)  # before ColwiseParallel's own input hook
        return super()._apply(module, device_mesh)


class _SequenceShardedEmbedding(RowwiseParallel):
    """A vocabulary-sharded embedding whose output is reduce-scattered along the sequence (dim 1), checking first
    that the sequence splits evenly over tp (sequence parallel cannot shard an uneven one)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=Shard(1))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()

        def check(mod: nn.Module, args: tuple) -> None:
            tokens = args[0]
            if tokens.dim() > 1 and tokens.shape[1] % tp:
                raise PlanError(
                    f"sequence length {tokens.shape[1]} is not divisible by tensor_parallel={tp}: sequence parallel "
                    f"shards the sequence over the tp ranks. Use a sequence length that is a multiple of {tp}, or "
                    "a plan without sequence parallel (cuboid.models.TP_PLAN_NO_SP for the reference Llama)."
                )

        module.register_forward_pre_hook(check)
        return super()._apply(module, device_mesh)


class _GatherSequence(ParallelStyle):
    """All-gather a module's first input along the sequence (dim 1) before it runs: the input arrives
    sequence-sharded (a local tensor or a ``Shard(1)`` DTensor) and the module gets a replicated DTensor (``local``:
    its local tensor), whose gradient is reduce-scattered back once in backward."""

    local = False

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            first, *rest = args
            if not isinstance(first, DTensor):
                first = DTensor.from_local(first, device_mesh, [Shard(1)], run_check=False)
            whole = first.redistribute(device_mesh, [Replicate()])
            return (whole.to_local() if self.local else whole, *rest), kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


class _ReplicatedSequence(_GatherSequence):
    """A module whole on every tp rank between sequence-parallel norms (Cuboid's MoE feed-forward): its first input
    is all-gathered along the sequence (dim 1) and handed over as a local tensor, so its own parameters (plain,
    the same on every tp rank) and its routing see the whole batch alike; its output, the same on every tp rank,
    goes back as this rank's part of the sequence. Backward all-gathers the output's gradient and keeps this rank's
    part of the input's: every rank computes the same full gradients, so nothing is summed over tp."""

    local = True

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def split(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            whole = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return whole.redistribute(device_mesh, [Shard(1)]).to_local()  # the residual stream is local

        module.register_forward_hook(split)
        return super()._apply(module, device_mesh)


class _LocalInput(ParallelStyle):
    """A module whose own parameters are whole on every tp rank, run on its first input as a local tensor: an input
    arriving as a DTensor (inside a module whose input was gathered, Cuboid's Llama attention; or sequence-sharded,
    before the output head) is made ``Replicate`` first. Its gradient is read as replicated: what comes back to it
    is the same on every tp rank (the module's output goes on as a replicated input of a tp-split layer, whose
    input gradient is summed over tp). A LoRA layer's ``lora_A`` beside a column-split base layer."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def local(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            first, *rest = args
            if not isinstance(first, DTensor):
                return None
            return (first.redistribute(device_mesh, [Replicate()]).to_local(), *rest), kwargs

        module.register_forward_pre_hook(local, with_kwargs=True)
        return module
