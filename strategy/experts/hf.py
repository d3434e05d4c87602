"""Expert parallel for transformers' mixture-of-experts layers (transformers 5.x).

transformers keeps each MoE layer's experts in one module with packed 3-D parameters (``gate_up_proj``:
experts x 2·intermediate x hidden, ``down_proj``: experts x hidden x intermediate; transposed, biased, ungated or
interleaved in some families: the ``use_experts_implementation`` decorator records which on the module), and
picks its forward by name from ``ExpertsInterface`` (``config._experts_implementation``), with the signature
``(module, hidden (tokens, hidden), top_k_index (tokens, k), top_k_weights (tokens, k)) -> (tokens, hidden)``.
The router runs before it, unchanged: top-k, normalisation and the auxiliary loss stay the model's own.

``distribute_experts`` (``shard_experts`` with plain tensors) keeps this rank's block of experts (dim 0 of every
packed parameter) and gives the module a forward that sends each chosen pair to the rank holding its expert,
computes the local experts and brings the results back (``cuboid.experts.dispatch``). Cuboid's own MoE
(``cuboid.models.moe``) keeps the same layout and attributes, so the same path serves it.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import MethodType

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from cuboid.experts.dispatch import ExpertParallelError, combine, dispatch, expert_block

PACKED = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
GROUP_ATTR = "_cuboid_ep_group"


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """transformers' packed experts modules in ``model`` (those its ``use_experts_implementation`` decorated)."""
    for name, module in model.named_modules():
        if hasattr(module, "is_transposed") and hasattr(module, "has_gate") and hasattr(module, "num_experts"):
            yield name, module


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's experts of a packed parameter: the local shard of a DTensor (experts split over ep; FSDP has
    gathered the rest for the forward), the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ weight if transposed else F.linear(x, weight)
    return out if bias is None else out + bias


def _grouped(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transposed: bool,
    offs: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Every local expert's projection of its rows in one grouped GEMM (``offs``: where each expert's rows end)."""
    weight = weight.to(rows.dtype)
    out = F.grouped_mm(rows, weight if transposed else weight.transpose(-2, -1), offs=offs)
    if bias is None:
        return out
    return out + bias.to(out.dtype).repeat_interleave(counts, dim=0, output_size=rows.shape[0])


def grouped_mm_runs(x: torch.Tensor, *dims: int) -> bool:
    """Whether ``F.grouped_mm`` (torch 2.11+) runs on ``x``'s device and dtype with matrices of these inner
    dimensions: any float on CPU, bf16 on CUDA (its kernel's only input type there), each dimension a multiple of
    16 bytes (its strides must be); elsewhere the experts run one by one."""
    if not hasattr(F, "grouped_mm") or any(d * x.element_size() % 16 for d in dims):
        return False
    return x.device.type == "cpu" or (x.device.type == "cuda" and x.dtype == torch.bfloat16)


def _local_experts(
    module: nn.Module, rows: torch.Tensor, counts: list[int], on_device: torch.Tensor | None = None
) -> torch.Tensor:
    """Each local expert on its rows (``rows`` grouped by expert, ``counts`` per expert; ``on_device``: the same
    counts where the exchange left them), with the module's own conventions (gate, activation, bias,
    transposition, post-expert norm). One grouped GEMM per projection where ``F.grouped_mm`` runs (CPU; bf16 on
    CUDA), else an exact loop; either way every local expert runs, on no rows when none came, so each has a
    gradient (zero) whatever the routing."""
    up = _local(module.gate_up_proj if module.has_gate else module.up_proj)
    up_bias = _local(getattr(module, "gate_up_proj_bias" if module.has_gate else "up_proj_bias", None))
    down, down_bias = _local(module.down_proj), _local(getattr(module, "down_proj_bias", None))
    if on_device is not None and grouped_mm_runs(rows, *up.shape[-2:], *down.shape[-2:]):
        offs = on_device.cumsum(0).to(torch.int32)
        bias_up, bias_down = (up_bias, down_bias) if module.has_bias else (None, None)
        h = _grouped(rows, up, bias_up, module.is_transposed, offs, on_device)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        h = _grouped(h, down, bias_down, module.is_transposed, offs, on_device)
        return module.post_expert_norm(h) if getattr(module, "has_post_expert_norm", False) else h
    outs, start = [], 0
    for e, n in enumerate(counts):
        x = rows[start : start + n]
        start += n
        h = _linear(x, up[e], up_bias[e] if module.has_bias else None, module.is_transposed)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        h = _linear(h, down[e], down_bias[e] if module.has_bias else None, module.is_transposed)
        if getattr(module, "has_post_expert_norm", False):
            h = module.post_expert_norm(h)
        outs.append(h)
    return torch.cat(outs)


def _ep_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The expert-parallel forward of a packed experts module (same signature as transformers' experts
    implementations): dispatch, local experts, combine."""
    group = getattr(module, GROUP_ATTR)
    rows, counts, routed = dispatch(hidden_states, top_k_index, module.num_experts, group)
    out = combine(_local_experts(module, rows, counts, routed.local_counts), top_k_weights, routed)
    return out.to(hidden_states.dtype)


def _route(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Send this module's forward through the exchange: the instance's ``forward`` is ``_ep_experts_forward`` (one
    path for every family, transformers' or not; hooks such as FSDP's still run, they sit on ``__call__``)."""
    setattr(module, GROUP_ATTR, group)
    module.forward = MethodType(_ep_experts_forward, module)


def _packed(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name in PACKED:
        param = getattr(module, name, None)
        if isinstance(param, nn.Parameter):
            if param.shape[0] != module.num_experts:
                raise ExpertParallelError(
                    f"{type(module).__name__}.{name} has shape {tuple(param.shape)}: expected the {module.num_experts} "
                    "experts packed on dim 0. Cuboid cannot split this layout over experts; leave expert_parallel=1."
                )
            yield name, param


def shard_experts(module: nn.Module, group: dist.ProcessGroup) -> tuple[int, int]:
    """Keep this rank's block of ``module``'s experts as plain tensors (dim 0 of each packed parameter) and route
    its forward through the exchange. ``module.num_experts`` stays the global count (the router's ids are global).
    Returns the block ``[start, stop)``."""
    start, stop = expert_block(module.num_experts, dist.get_world_size(group), dist.get_rank(group))
    for name, param in list(_packed(module)):
        setattr(module, name, nn.Parameter(param.detach()[start:stop].clone(), requires_grad=param.requires_grad))
    _route(module, group)
    return start, stop


def distribute_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """As ``shard_experts``, with each packed parameter a DTensor ``Shard(0)`` over the 1-D ``ep_mesh``: its global
    shape stays the whole layer's, so checkpoints and FSDP (over the data-parallel ranks that hold the same
    experts) see the layer as it is. Meta parameters stay on meta (materialized later, slice by slice)."""
    group = ep_mesh.get_group()
    start, stop = expert_block(module.num_experts, ep_mesh.size(), ep_mesh.get_local_rank())
    for name, param in list(_packed(module)):
        local = param.detach()[start:stop]
        local = local if local.is_meta else local.clone()
        shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(module, name, nn.Parameter(shard, requires_grad=param.requires_grad))
    _route(module, group)
