"""The parameters tensor parallel leaves whole get the same gradient on every tp rank, or the run stops at its first
optimizer step, before any weight changes.

A tp plan splits some modules' weights over the tp ranks and leaves the rest whole on each (replicated). A whole
parameter that is used on this rank's share of the features (between a ``colwise`` and a ``rowwise`` layer: a
learned activation such as Apertus's xIELU ``act_fn.alpha_p``, a per-head norm the plan does not name) gets on each
rank the gradient of its share only. Nothing sums those over tp, so each rank would update its own copy from its
share and the copies drift apart, with no error: the loss stays close for a while and the weights do not.

:class:`TpGradients` (installed for fitting when ``tensor_parallel > 1``) compares, at the first optimizer step of
each fit, every such parameter's local gradient (its norm and its sum) over the tp ranks of one replica: one small
all-gather and one host read, once. A parameter whose gradients differ is named in :class:`TpGradientsDiffer`,
with the fix (the plan's ``replicated_with_grad_allreduce``, which sums them over tp). Parameters split over the
tp ranks (a ``Shard`` placement on a mesh dimension that spans them) are not compared: their shards differ by
design.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from cuboid import compat

# Two ranks' statistics agree when they differ by at most this share of the larger: the same gradient computed on
# two ranks can differ in its last bits (GPU kernels that accumulate with atomics, bf16 reductions), a share of the
# features' gradient differs from another share's by far more.
TOLERANCE = 2e-2


class TpGradientsDiffer(RuntimeError):
    """Parameters left whole on every tp rank got different gradients on the tp ranks of one replica."""


def split_over(param: torch.Tensor, peers: set[int], seen: dict[tuple[int, int], bool] | None = None) -> bool:
    """Whether ``param`` is sharded over some of the ranks ``peers`` (global ranks): a DTensor with a ``Shard``
    placement on a mesh dimension whose ranks include another of them. Read from the process groups, not the mesh
    dimensions' names, so that a model parallelized by hand on a mesh of its own counts too. ``seen`` keeps the
    answer per mesh dimension across calls (the parameters of a model share a few meshes)."""
    if not isinstance(param, DTensor):
        return False
    mesh, seen = param.device_mesh, {} if seen is None else seen

    def spans(dim: int) -> bool:
        key = (id(mesh), dim)
        if key not in seen:
            seen[key] = len(set(dist.get_process_group_ranks(mesh.get_group(dim))) & peers) > 1
        return seen[key]

    return any(isinstance(placement, Shard) and spans(i) for i, placement in enumerate(param.placements))


def _statistics(grad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if grad is None:
        return torch.zeros(2, device=device)
    local = (grad.to_local() if isinstance(grad, DTensor) else grad).detach().float()
    return torch.stack([torch.linalg.vector_norm(local), local.sum()]).to(device)


def check_tp_gradients(named: Iterable[tuple[str, torch.Tensor]], group: Any, device: torch.device) -> None:
    """Compare the local gradients of the parameters ``tp`` leaves whole over ``group`` (this rank's tp ranks; a
    collective, every rank of it calls it). Raises :class:`TpGradientsDiffer` naming those that differ."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    peers = set(dist.get_process_group_ranks(group))
    seen: dict[tuple[int, int], bool] = {}
    whole = [(name, p) for name, p in named if p.requires_grad and not split_over(p, peers, seen)]
    if not whole:
        return
    local = torch.stack([_statistics(p.grad, device) for _, p in whole])  # (params, 2)
    gathered = torch.empty((size * len(whole), 2), device=device)
    compat.all_gather_single(gathered, local, group=group)
    stats = gathered.view(size, len(whole), 2).cpu()  # the one host read
    spread = (stats - stats[0]).abs().amax(0)  # (params, 2): the largest difference from the first rank
    scale = stats.abs().amax(0)
    differ = [name for (name, _), d, s in zip(whole, spread, scale, strict=True) if bool((d > TOLERANCE * s).any())]
    if differ:
        shown = ", ".join(differ[:6]) + (f" (and {len(differ) - 6} more)" if len(differ) > 6 else "")
        modules = sorted({re.sub(r"\.\d+\.", ".*.", name.rsplit(".", 1)[0]) for name in differ})  # as globs
        raise TpGradientsDiffer(
            f"tensor_parallel={size}: {len(differ)} parameter(s) that the tensor-parallel plan leaves whole on every "
            f"tp rank got different gradients on the tp ranks of one replica: {shown}. Each is used on this rank's "
            "share of the features (between a colwise and a rowwise layer), so each rank sees only its share's "
            "gradient and the copies would drift apart. Stopped at the first optimizer step, before any weight "
            f"changed. Add their modules ({', '.join(modules[:3])}{', ...' if len(modules) > 3 else ''}) to "
            "tensor_parallel_plan as 'replicated_with_grad_allreduce' (which sums their gradients over tp; a plan "
            "you pass replaces the model's own, which cuboid.parallel.plans.find_model_plan(module) gives you to "
            "extend), or use tensor_parallel=1."
        )


class TpGradients(L.Callback):
    """Runs :func:`check_tp_gradients` at the first optimizer step of each fit (see the module's docstring)."""

    def __init__(self, trainer: L.Trainer, group: Any) -> None:
        self.trainer, self.group = trainer, group
        self.pending = False

    def install(self) -> None:
        """Join the trainer's callbacks (for one fit: :meth:`uninstall` at its teardown)."""
        self.trainer.callbacks.append(self)

    def uninstall(self) -> None:
        if self in self.trainer.callbacks:
            self.trainer.callbacks.remove(self)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.pending = True

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.pending:
            self.pending = False
            check_tp_gradients(pl_module.named_parameters(), self.group, pl_module.device)
