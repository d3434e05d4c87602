"""The global gradient norm across every shard of every parameter, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` cannot stack norms of DTensors that live on different meshes
(FSDP-only parameters on ``dp_shard``, FSDP+TP ones on ``(dp_shard, tp)``). Here each rank sums
the squares of its local shards, counting a shard that other ranks also hold (replicated over
``tp``, ``dp_replicate`` or another mesh dim) only on the first of them, and one all-reduce over
the world adds them up. Every rank gets the same bits; pipeline stages hold different
parameters, so they are summed, never de-duplicated.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cuboid.compat import foreach_mul_

# Dims of the root mesh along which different ranks hold *different* parameters.
_NOT_REPLICATED = ("pp",)


def _counts_here(tensor: torch.Tensor, coords: Mapping[str, int], flattened: Mapping[str, tuple[str, ...]]) -> bool:
    """True when this rank is the one that counts its local shard of ``tensor``."""
    replicated = set(coords) - set(_NOT_REPLICATED)
    if isinstance(tensor, DTensor):
        for name, placement in zip(tensor.device_mesh.mesh_dim_names or (), tensor.placements, strict=True):
            dims = flattened.get(name, (name,))
            if placement.is_partial():
                raise RuntimeError(f"gradient with a Partial placement on {name!r}: reduce it before clipping")
            if not placement.is_replicate():
                replicated -= set(dims)
    return all(coords[d] == 0 for d in replicated)


def _by_device_and_dtype(grads: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Local tensors of the gradients (a DTensor's shard), grouped so that each group fits one foreach kernel."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        groups.setdefault((local.device, local.dtype), []).append(local)
    return groups


def global_grad_norm(
    parameters: Iterable[torch.Tensor],
    mesh: DeviceMesh | None,
    flattened: Mapping[str, tuple[str, ...]],
    counted_elsewhere: Collection[int] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """L2 norm of all gradients as if the model were on one device (foreach norms per dtype, summed in fp64;
    fp32 result, on ``device``). ``counted_elsewhere``: ids of parameters another rank counts (this rank's copy
    of a parameter tied across pipeline stages). ``device``: where the sum is all-reduced, the process group's
    device (the accelerator under CPU offload, whose gradients are on the host; NCCL takes no host tensor);
    default: the mesh's device type (its current device), else the gradients' device."""
    grads = [p.grad for p in parameters if p.grad is not None and id(p) not in counted_elsewhere]
    if device is None and mesh is not None and mesh.device_type != "cpu":
        device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    if mesh is None:
        coords: dict[str, int] = {}
    else:
        coords = dict(zip(mesh.mesh_dim_names or (), mesh.get_coordinate() or (), strict=True))
    total = torch.zeros((), dtype=torch.float64, device=device)
    counted = _by_device_and_dtype(g.detach() for g in grads if _counts_here(g, coords, flattened))
    for tensors in counted.values():  # a few foreach kernels per dtype, not several per parameter
        total += torch.nn.utils.get_total_norm(tensors, 2.0, foreach=True).to(total.device, torch.float64).square()
    if mesh is not None and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.sqrt().float()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    mesh: DeviceMesh | None,
    flattened: Mapping[str, tuple[str, ...]],
    counted_elsewhere: Collection[int] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm (on ``device``, as
    :func:`global_grad_norm`).

    Same rule as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))``.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params, mesh, flattened, counted_elsewhere, device)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for (dev, dtype), tensors in _by_device_and_dtype(p.grad for p in params).items():
        foreach_mul_(tensors, coef.to(dev, dtype))
    return norm
