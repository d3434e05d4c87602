"""``Trainer(sync_batchnorm=True)`` under Cuboid: BatchNorm's batch statistics over the data-parallel group.

torch's ``nn.SyncBatchNorm`` runs only on accelerators (its forward refuses CPU tensors), so Cuboid converts each
BatchNorm into :class:`DataParallelBatchNorm`, which works on every device and backend: the per-channel sum and
count, then the sum of squared deviations from the global mean, are all-reduced over the data-parallel ranks (two
small all-reduces per layer, differentiable), so a step normalizes with the statistics of the whole global batch, as
one process on that batch does. Tensor-parallel peers read the same samples and are not in the group. Under context
parallel a sequence's positions are split over ranks: refused (:func:`_check_sync_batchnorm`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from cuboid.parallel.mesh import LayoutError

BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the all-reduce of the gradient: each rank's share of a global sum."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class DataParallelBatchNorm(nn.SyncBatchNorm):
    """A BatchNorm whose training-mode statistics are the whole data-parallel group's batch (see the module
    docstring). Running statistics are updated with them (the unbiased variance over the global count), the same on
    every rank; evaluation uses the running statistics, as BatchNorm does."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002  (nn.Module's name)
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average: 1 / batches seen, as a tensor (no host read)
                factor = 1.0 / self.num_batches_tracked
        group = self.process_group
        if not self.training or group is None or dist.get_world_size(group) == 1:
            batch_stats = self.training or (self.running_mean is None and self.running_var is None)
            keep = not self.training or self.track_running_stats  # as torch's BatchNorm chooses
            return F.batch_norm(
                input,
                self.running_mean if keep else None,
                self.running_var if keep else None,
                self.weight,
                self.bias,
                batch_stats,
                float(factor),  # a tensor only for momentum=None
                self.eps,
            )
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float()
        count = x.new_full((1,), x.numel() // x.size(1))
        total = _SumOverGroup.apply(torch.cat([x.sum(dims), count]), group)
        n = total[-1]
        mean = total[:-1] / n
        centred = x - mean.view(shape)
        var = _SumOverGroup.apply((centred * centred).sum(dims), group) / n
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (n / (n - 1).clamp(min=1))
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.detach().to(self.running_var.dtype), factor)
        return out.to(input.dtype)


def _convert_batchnorm(module: nn.Module, group: dist.ProcessGroup) -> int:
    """Replace every BatchNorm under ``module`` by a :class:`DataParallelBatchNorm` over ``group``, in place,
    keeping its parameters, buffers and mode; return how many were converted."""
    converted = 0
    for name, child in list(module.named_children()):
        if isinstance(child, BATCHNORMS) and not isinstance(child, DataParallelBatchNorm):
            new = DataParallelBatchNorm(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats, group
            )
            if child.affine:
                new.weight, new.bias = child.weight, child.bias
            new.running_mean, new.running_var = child.running_mean, child.running_var
            new.num_batches_tracked = child.num_batches_tracked
            new.train(child.training)
            setattr(module, name, new)
            converted += 1
        else:
            converted += _convert_batchnorm(child, group)
    return converted


def _check_sync_batchnorm(layout: Any) -> None:
    """``sync_batchnorm=True`` on a layout where it cannot mean what it means under DDP: refused, with why."""
    if layout.cp > 1:
        raise LayoutError(
            f"Trainer(sync_batchnorm=True) with context_parallel={layout.cp}: each sequence's positions are split "
            "over the context-parallel ranks, so BatchNorm's statistics over the data-parallel group would miss "
            "part of every sequence. Set context_parallel=1, or drop sync_batchnorm."
        )


def sync_batchnorm(layer_sync: Any, layout: Any, module: nn.Module, group: dist.ProcessGroup) -> None:
    """What ``Trainer(sync_batchnorm=True)`` asks (``layer_sync``, Lightning's plugin, or ``None``): every BatchNorm
    under ``module`` synced over ``group``. Any other ``LayerSync`` plugin is refused by name: what it does to a
    sharded model is unknown."""
    if layer_sync is None:
        return
    if not isinstance(layer_sync, TorchSyncBatchNorm):
        raise TypeError(
            f"Trainer(plugins=[{type(layer_sync).__name__}()]): CuboidStrategy honours only "
            "Trainer(sync_batchnorm=True) (BatchNorm synced over the data-parallel group). Remove the plugin."
        )
    _check_sync_batchnorm(layout)
    converted = _convert_batchnorm(module, group)
    rank_zero_info(f"Cuboid: sync_batchnorm: {converted} BatchNorm layers synced over the data-parallel group")
