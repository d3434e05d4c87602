"""Expert load: how many tokens each expert of each MoE layer received in a training step, summed over the
data-parallel (and context-parallel) ranks, as the figures :class:`cuboid.callbacks.CuboidMonitor` logs on its
logging steps.

Counting happens on the device only (``index_add_`` of the router's choices, no ``bincount`` or boolean
indexing, which read back to the host on a GPU), and only while switched on: the monitor switches it on for the
forward passes of a step that logs and off before backward (an activation-checkpointing recompute is not
counted twice). On a logging step the counts cost one small all-reduce per data-parallel dimension and one host
read; other steps run nothing of this.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from cuboid.experts.dispatch import pairs_per_expert
from cuboid.experts.hf import experts_modules

__all__ = ["ExpertLoad", "load_figures"]


def _top_k_index(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``(tokens, k)`` expert ids an experts module is called with (transformers' signature and Cuboid's:
    ``(hidden, top_k_index, top_k_weights)``)."""
    if "top_k_index" in kwargs:
        return kwargs["top_k_index"]
    return args[1] if len(args) > 1 and torch.is_tensor(args[1]) else None


class ExpertLoad:
    """Counts the (token, expert) pairs routed to every expert of every packed experts module in ``model``
    while :attr:`on`; pairs a model drops (expert id ``num_experts`` or more) are not counted."""

    def __init__(self, model: nn.Module) -> None:
        self.on = False
        self.names: list[str] = []
        self.counts: list[torch.Tensor | None] = []
        self._handles = []
        for name, module in experts_modules(model):
            self._handles.append(module.register_forward_pre_hook(self._hook(len(self.names)), with_kwargs=True))
            self.names.append(name)
            self.counts.append(None)

    def __len__(self) -> int:
        return len(self.names)

    def _hook(self, i: int):
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            index = _top_k_index(args, kwargs) if self.on and torch.is_grad_enabled() else None
            if index is None:
                return
            counts = pairs_per_expert(index, module.num_experts, torch.float32)
            self.counts[i] = counts if self.counts[i] is None else self.counts[i] + counts

        return count

    def take(self, groups: list[dist.ProcessGroup]) -> dict[str, float] | None:
        """The step's figures (see :func:`load_figures`), summed over ``groups`` (every rank of each group calls
        this), and the counts reset. ``None`` when no layer counted anything (every rank agrees: the counts follow
        the same module calls)."""
        counted = [c for c in self.counts if c is not None]
        self.counts = [None] * len(self.names)
        if not counted or len(counted) != len(self.names):
            return None
        stacked = torch.stack(counted)  # (layers, experts), one tensor: one reduce per group
        for group in groups:
            dist.all_reduce(stacked, group=group)
        return load_figures(stacked.cpu())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def load_figures(counts: torch.Tensor) -> dict[str, float]:
    """From tokens per expert ``(layers, experts)``: ``moe/tokens_per_expert_max`` (the busiest expert of any
    layer), ``moe/tokens_per_expert_mean`` (a layer's pairs over its experts, averaged over layers),
    ``moe/load_imbalance`` (the largest max / mean of any layer: 1.0 is perfectly balanced) and
    ``moe/idle_experts`` (experts of any layer that got no token)."""
    counts = counts.double()
    mean = counts.mean(dim=1)
    worst = counts.max(dim=1).values
    ratio = torch.where(mean > 0, worst / mean.clamp(min=1e-12), torch.zeros_like(mean))
    return {
        "moe/tokens_per_expert_max": float(worst.max()),
        "moe/tokens_per_expert_mean": float(mean.mean()),
        "moe/load_imbalance": float(ratio.max()),
        "moe/idle_experts": float((counts == 0).sum()),
    }
