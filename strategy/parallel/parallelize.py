"""Where each parallelism is applied, one function each, in one visible order (torchtitan style).

:func:`parallelize` runs, per model: tensor parallel (:func:`apply_tp`), expert parallel (:func:`apply_ep`),
activation checkpointing (:func:`apply_ac`), ``torch.compile`` (:func:`apply_compile`), then FSDP2
(:func:`apply_fsdp`) per block (each MoE layer's experts first) and on each root module, with explicit
forward/backward prefetch.
None of these change parameter names (FQNs), so checkpoints read the same on any layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils.checkpoint import checkpoint, noop_context_fn

from cuboid.compat import SDPA_OPS, RepeatableRecompute, reads_kv_cache_only, torch_function_modes
from cuboid.dropin import STEP_METHODS
from cuboid.experts import ExpertParallelError, RoutingReplay, distribute_experts, experts_modules
from cuboid.parallel.mesh import ExpertsLayout
from cuboid.parallel.styles import PlanError

ACMode = Literal["full", "selective"]


def check_ac_mode(mode: object) -> None:
    """``activation_checkpointing`` is None or one of :data:`ACMode`'s values."""
    allowed = get_args(ACMode)
    if mode is not None and mode not in allowed:
        raise ValueError(f"activation_checkpointing={mode!r}; choose None, {', '.join(map(repr, allowed))}.")


# Ops whose outputs selective activation checkpointing keeps (the expensive ones, and the tensor-parallel
# collectives, which a recompute would otherwise run again); the rest (norms, activations, elementwise) are
# recomputed in backward.
_SAC_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    *SDPA_OPS,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}
# (Not the routers' topk, as torchtitan saves it: transformers' Qwen3-MoE normalizes its top-k weights in place,
# which SAC refuses for a cached output. A recompute routes as its forward did: same inputs, same kernels.)


def apply_tp(root: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> None:
    """Shard the modules named in ``plan`` over the ``tp`` mesh (DTensor ``parallelize_module``)."""
    if tp_mesh.size() == 1 or not plan:
        return
    frozen = {name for name, param in root.named_parameters() if not param.requires_grad}
    tied = tied_parameters(root)
    parallelize_module(root, tp_mesh, dict(plan))
    retie(root, tied)
    # torch's SequenceParallel re-registers a module's parameters as new ones that require gradients (torch 2.13):
    # a frozen norm (a LoRA fine-tune's base) would train under tp. Frozen stays frozen.
    for name, param in root.named_parameters():
        if name in frozen and param.requires_grad:
            param.requires_grad_(False)


def tied_parameters(root: nn.Module) -> list[list[str]]:
    """The parameters held under more than one name (tied input and output embeddings), each as its names."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(root: nn.Module, tied: list[list[str]]) -> None:
    """Tie again what :func:`tied_parameters` found. ``parallelize_module`` gives each module it shards a parameter
    of its own: a tied embedding and head became two parameters, each trained by its own gradient only (measured:
    transformers' Llama and Gemma 3 with ``tie_word_embeddings`` at tp2 drifted 2e-3 from one process in 12 steps).
    Each name now holds its first name's sharded parameter, which takes both gradients."""
    for names in tied:
        params = [root.get_parameter(name) for name in names]
        if all(param is params[0] for param in params):
            continue
        layouts = [(p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None for p in params]
        if any(layout != layouts[0] for layout in layouts):
            shown = ", ".join(
                f"{name}: {'not sharded' if layout is None else list(layout[1])}"
                for name, layout in zip(names, layouts, strict=True)
            )
            raise PlanError(
                f"{' and '.join(names)} are one parameter (tied), but the tensor-parallel plan shards it differently "
                f"in each ({shown}). Give their modules styles that shard the weight alike (transformers' own "
                "plans: 'embedding_rowwise' for the embedding and 'colwise_gather_output' for the head both shard "
                "the vocabulary), or untie them (tie_word_embeddings=False)."
            )
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(root.get_submodule(owner), attr, params[0])


def _sac_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# Keyword arguments through which a Hugging Face layer reads *and updates* its KV cache. A checkpointed layer
# must not get them in training: the recompute in backward would see the cache its own forward updated (a
# different graph: selective checkpointing fails, full checkpointing recomputes against the wrong keys).
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _drop_kv_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """What transformers' own ``GradientCheckpointingLayer`` does under gradient checkpointing: in training with
    gradients, ``use_cache=False`` and no cache object (unless the layer only reads it)."""
    if not (module.training and torch.is_grad_enabled()):
        return None
    drop = [] if reads_kv_cache_only(module) else [n for n in _CACHE_KWARGS if kwargs.get(n) is not None]
    if not (drop or kwargs.get("use_cache")):
        return None  # nothing to change: no copy of the arguments on every block's forward
    changed = {**kwargs, **dict.fromkeys(drop)}
    if changed.get("use_cache"):
        changed["use_cache"] = False
    return args, changed


def apply_ac(blocks: Sequence[tuple[str, nn.Module]], mode: ACMode | None) -> None:
    """Activation checkpointing per block, without wrapping (FQNs unchanged).

    ``"full"`` recomputes the whole block in backward; ``"selective"`` keeps matmul and attention
    outputs and recomputes the cheap ops in between. A block's KV-cache arguments (Hugging Face layers) are
    dropped in training, before the checkpoint captures its inputs.
    """
    if mode is None:
        return
    context_fn = _sac_context if mode == "selective" else noop_context_fn
    for _, block in blocks:
        block.forward = _checkpointed(block.forward, context_fn)  # an instance attribute: names unchanged
        block.register_forward_pre_hook(_drop_kv_cache, with_kwargs=True, prepend=True)


def _checkpointed(forward: Callable[..., Any], context_fn: Callable[[], Any]) -> Callable[..., Any]:
    """``forward`` under ``torch.utils.checkpoint``. Inside the block's own forward (not hooks around it), so that
    ``compile=True`` traces the checkpoint with the block and applies the selective policy inside the compiled
    graph, and FSDP2's hooks (all-gather before forward and before backward) stay outside the recompute."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Eager: the recompute runs under the forward's TorchFunctionModes. Compiled (compile=True), Dynamo traces
        # the checkpoint with the context_fn as given (it takes no other kind) and replays its own graph.
        fn = context_fn if torch.compiler.is_compiling() else _with_forward_modes(context_fn)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=fn, **kwargs)

    return run


def _with_forward_modes(context_fn: Callable[[], Any]) -> Callable[[], Any]:
    """``context_fn`` whose recompute also runs under the ``TorchFunctionMode``s the forward ran under (context
    parallel's attention and loss interceptor): the autograd engine runs the recompute without them. An expert
    layer's exchanged counts are taken from the forward (:class:`cuboid.experts.RoutingReplay`): no second host read
    and count exchange in the recompute."""

    def contexts() -> tuple[Any, Any]:
        forward_ctx, recompute_ctx = context_fn()
        if hasattr(recompute_ctx, "storage"):  # selective: its saved outputs serve every recompute (zero-bubble: 2)
            recompute_ctx = RepeatableRecompute(recompute_ctx)
        modes = torch_function_modes()
        replay = RoutingReplay()

        @contextmanager
        def forward() -> Generator[None, None, None]:
            with forward_ctx, replay.recording():
                yield

        def recompute() -> ExitStack:  # entered
            stack = ExitStack()
            for mode in modes:
                stack.enter_context(mode)
            stack.enter_context(recompute_ctx)
            stack.enter_context(replay.replaying())
            return stack

        return forward(), _EachTime(recompute)  # entered once per recompute: twice under a zero-bubble schedule

    return contexts


class _EachTime:
    """A context entered anew each time: ``enter()`` enters its parts and returns the ``ExitStack`` that leaves them
    (a generator-made context manager can be entered once only)."""

    def __init__(self, enter: Callable[[], ExitStack]) -> None:
        self.enter, self.open = enter, []

    def __enter__(self) -> None:
        self.open.append(self.enter())

    def __exit__(self, *exc: Any) -> Any:
        return self.open.pop().__exit__(*exc)


def apply_compile(blocks: Sequence[tuple[str, nn.Module]]) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile`` keeps parameter names)."""
    for _, block in blocks:
        block.compile()


Part = tuple[nn.Module, Sequence[tuple[str, nn.Module]]]  # (root, its blocks): a model, or a pipeline stage


def moe_layers(blocks: Sequence[tuple[str, nn.Module]], ep: int) -> list[nn.Module]:
    """The packed experts modules of ``blocks`` that expert parallel splits; a clear error for a dense model and for
    experts kept in a layout Cuboid does not know (a list of per-expert modules)."""
    found: list[nn.Module] = []
    unknown: list[str] = []
    for block_name, block in blocks:
        found += [m for _, m in experts_modules(block)]
        unknown += [
            f"{block_name}.{name} ({type(m).__name__} of {len(m)} {type(next(iter(m.children()))).__name__})"
            for name, m in block.named_modules()
            if name.rsplit(".", 1)[-1] == "experts" and isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)
        ]
    if unknown:
        raise ExpertParallelError(
            f"expert_parallel={ep}: {unknown[0]} holds its experts as separate modules, a mixture-of-experts layout "
            "Cuboid cannot split. It splits packed experts (num_experts, gate_up_proj or up_proj, and down_proj with "
            "the experts on dim 0), as transformers 5 and cuboid.models.moe keep them: use such a model, or "
            "expert_parallel=1."
        )
    if not found:
        raise ExpertParallelError(
            f"expert_parallel={ep} but no block holds a mixture-of-experts layer (packed experts: num_experts and "
            "gate_up_proj/up_proj and down_proj with the experts on dim 0, as transformers 5 and cuboid.models.moe "
            "keep them). For a dense model, leave expert_parallel=1."
        )
    return found


def apply_ep(blocks: Sequence[tuple[str, nn.Module]], experts: ExpertsLayout) -> None:
    """Split the packed experts of every MoE layer in ``blocks`` over ``experts.ep_mesh`` (``cuboid.experts``)."""
    for module in moe_layers(blocks, experts.ep_mesh.size()):
        distribute_experts(module, experts.ep_mesh)


def apply_fsdp(
    parts: Sequence[Part],
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    experts: ExpertsLayout | None = None,
    step_root: nn.Module | None = None,
) -> None:
    """FSDP2 per block, then on each part's root; prefetch the neighbouring block's all-gather. Under expert
    parallel each MoE layer's experts get their own FSDP unit first, over ``experts.fsdp_mesh``. ``step_root`` (the
    LightningModule, the last part's root) is gathered for each whole step: its step methods are its forward
    methods, it is not resharded between forward and backward, and its parameters keep their dtype and its inputs
    theirs (what it holds is what no other unit could: a DDP project's modules, in their own precision).

    Each block's parameters are all-gathered right before its forward and freed after it
    (``reshard_after_forward=True``; the last block stays gathered until its backward, which follows at
    once), and its gradients reduce-scattered in backward. A root (the
    LightningModule's top-level child, or a pipeline stage) gets the leftover parameters
    (embeddings, final norm, head) and is kept unsharded between forward and backward.
    """
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    # FSDP2 takes no 0-d parameter (a learned temperature): such stay whole, their gradients averaged as DDP's
    scalars = {p for root, _ in parts for p in root.parameters() if p.dim() == 0} or None
    shard = partial(fully_shard, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload, ignored_params=scalars)
    for root, blocks in parts:
        for i, (_, block) in enumerate(blocks):
            # The last block's backward comes right after its forward (only the head's lies between): resharding
            # it would free its parameters only to gather them again at once (torchtitan keeps it gathered too).
            last = i == len(blocks) - 1 and reshard_after_forward is True
            for _, module in experts_modules(block) if experts is not None else ():
                keep = last or reshard_after_forward is False  # (a partial reshard size is dp_shard's, not efsdp's)
                fully_shard(module, mesh=experts.fsdp_mesh, mp_policy=mp_policy, offload_policy=offload,
                            reshard_after_forward=not keep)  # fmt: skip
                module.set_gradient_divide_factor(float(experts.dp))  # type: ignore[operator]
                if dist.get_backend() == "gloo" and experts.fsdp_mesh.size(experts.fsdp_mesh.ndim - 1) > 1:
                    # gloo has no PREMUL_SUM: reduce-scatter by SUM, then divide. (Not over one rank, where torch
                    # 2.13's FSDP would divide twice.)
                    module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
            shard(block, reshard_after_forward=False if last else reshard_after_forward)
        if root is step_root:
            whole = MixedPrecisionPolicy(reduce_dtype=mp_policy.reduce_dtype, cast_forward_inputs=False)
            fully_shard(root, mesh=dp_mesh, mp_policy=whole, offload_policy=offload, reshard_after_forward=False,
                        ignored_params=scalars)  # fmt: skip
            for method in STEP_METHODS:
                register_fsdp_forward_method(root, method)
        else:
            shard(root)
        # Each block's all-gather is issued a block ahead, its MoE layers' experts (units of their own, the bulk of
        # a block's bytes) with it, as torchtitan's llama4 does: else they are gathered just in time, after the router
        units: list[tuple[FSDPModule, list[FSDPModule]]] = [
            (block, [m for _, m in experts_modules(block)] if experts is not None else [])  # type: ignore[misc]
            for _, block in blocks
        ]
        for (prev, prev_experts), (nxt, nxt_experts) in zip(units, units[1:], strict=False):
            prev.set_modules_to_forward_prefetch([nxt, *nxt_experts])
            nxt.set_modules_to_backward_prefetch([prev, *prev_experts])


def parallelize(
    parts: Sequence[Part],
    *,
    tp_root: nn.Module,
    tp_mesh: DeviceMesh,
    tp_plan: Mapping[str, ParallelStyle],
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    activation_checkpointing: ACMode | None,
    compile: bool,
    reshard_after_forward: bool | int,
    cpu_offload: bool,
    experts: ExpertsLayout | None = None,
    step_root: nn.Module | None = None,
) -> None:
    """Apply TP -> EP -> AC -> compile -> FSDP2, in that order: tensor parallel first (DTensor parameters), then
    the experts' split, checkpointing and compilation of the sharded blocks, FSDP2 last (it shards whatever TP and
    EP left).

    ``tp_plan`` names modules relative to ``tp_root``; ``parts`` are the FSDP roots with their blocks.
    """
    apply_tp(tp_root, tp_mesh, tp_plan)
    blocks = [b for _, part_blocks in parts for b in part_blocks]
    if experts is not None:
        apply_ep(blocks, experts)
    apply_ac(blocks, activation_checkpointing)
    if compile:
        apply_compile(blocks)
    apply_fsdp(parts, dp_mesh, mp_policy, reshard_after_forward, cpu_offload, experts, step_root)


def check_no_fsdp1(module: nn.Module) -> None:
    """Refuse FSDP1 (``FullyShardedDataParallel``) wrappers: Cuboid applies FSDP2 itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = [
        name or type(module).__name__ for name, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)
    ]
    if wrapped:
        raise TypeError(
            f"Found modules wrapped in torch.distributed.fsdp.FullyShardedDataParallel (FSDP1): {wrapped[:3]}. "
            "CuboidStrategy applies FSDP2 (fully_shard) itself: remove the FSDP wrapping from your model or "
            "configure_model."
        )


def is_parallelized_by_user(module: nn.Module) -> bool:
    """True when configure_model already applied fully_shard or made DTensor parameters."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )
