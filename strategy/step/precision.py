"""Trainer precision, mapped onto FSDP2's MixedPrecisionPolicy, and global-norm gradient clipping.

Lightning picks an autocast plugin for ``bf16-mixed`` and a module-casting one for ``bf16-true``
when the strategy is not one of its own. Under FSDP2 neither is right: FSDP2 casts the
all-gathered parameters itself. :class:`CuboidPrecision` replaces whatever plugin Lightning
chose, keeps Lightning's own precision name, and owns gradient clipping (the norm is global
across all shards, see :mod:`cuboid.step.grad_norm`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

from cuboid.step.accumulation import DeferredReductions
from cuboid.step.grad_norm import clip_grad_norm_, global_grad_norm
from cuboid.step.nonfinite import NonFiniteGuard

SUPPORTED: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")


class PrecisionPolicy:
    """What Cuboid's precision plugins share, the Trainer's (:class:`CuboidPrecision`) and Fabric's
    (:class:`cuboid.fabric.FabricPrecision`):

    * ``"32-true"``: fp32 everywhere.
    * ``"bf16-mixed"``: fp32 sharded parameters and optimizer state; FSDP2 all-gathers bf16
      copies for compute and reduces gradients in fp32.
    * ``"bf16-true"``: the model itself is bf16 (parameters, gradients, optimizer state).
    """

    def __init__(
        self,
        precision: str = "32-true",
        device_mesh: DeviceMesh | None = None,
        flattened_dims: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        """``device_mesh`` (with ``flattened_dims``, names of flattened sub-meshes -> the dims they cover): the
        mesh the gradient norm is reduced over; the strategy makes its plugin with it once the mesh exists."""
        if precision not in SUPPORTED:
            raise ValueError(
                f"CuboidStrategy does not support precision={precision!r}. Choose one of {', '.join(SUPPORTED)}."
            )
        self.precision = precision  # type: ignore[assignment]
        self.device_mesh = device_mesh
        self.flattened_dims: Mapping[str, tuple[str, ...]] = dict(flattened_dims or {})
        self.last_grad_norm: torch.Tensor | None = None

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        if self.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-true" else torch.float32

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=torch.bfloat16) if self.precision == "bf16-true" else module

    @contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.param_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(data, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)


class CuboidPrecision(PrecisionPolicy, Precision):
    """The Trainer's precision plugin for :class:`~cuboid.CuboidStrategy` (see :class:`PrecisionPolicy`), with
    global-norm clipping and the non-finite check. ``autocast_device``: under ``"bf16-mixed"`` with the model
    replicated (DDP, no FSDP2 to cast its parameters), each step runs under ``torch.autocast`` on that device type,
    as Lightning's own mixed precision runs it."""

    autocast_device: str | None = None

    def __init__(
        self,
        precision: str = "32-true",
        device_mesh: DeviceMesh | None = None,
        flattened_dims: Mapping[str, tuple[str, ...]] | None = None,
        *,
        nonfinite: NonFiniteGuard | None = None,
        commit: Callable[[], bool] | None = None,
        deferred: DeferredReductions | None = None,
        counted_elsewhere: Callable[[], Collection[int]] = frozenset,
    ) -> None:
        """The step's hooks, each the strategy's, handed in: ``nonfinite``, the check of ``nonfinite=`` (none
        checks nothing); ``commit``, whether a fault-tolerant replica group's step may commit (None: no groups);
        ``deferred``, the reductions checked after the step's last backward; ``counted_elsewhere``, asked at each
        norm for the ids of the parameters whose norm another rank counts (tied over pp)."""
        super().__init__(precision, device_mesh, flattened_dims)
        self.nonfinite = nonfinite if nonfinite is not None else NonFiniteGuard(None)
        self.commit = commit
        self.deferred = deferred
        self._counted_elsewhere = counted_elsewhere

    @property
    def counted_elsewhere(self) -> Collection[int]:
        """Ids of the parameters whose gradient norm another rank counts (a weight tied across pp stages)."""
        return self._counted_elsewhere()

    @override
    def forward_context(self) -> Any:
        if self.autocast_device is None:
            return super().forward_context()
        return torch.autocast(self.autocast_device, dtype=torch.bfloat16)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.last_grad_norm = clip_grad_norm_(
            params, float(clip_val), self.device_mesh, self.flattened_dims, self.counted_elsewhere
        )

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's order (closure: step and backward; then ``on_before_optimizer_step`` and clipping), with the
        replica groups' commit and the non-finite check (``nonfinite=``) between the closure and the optimizer step
        when they are on; after the closure, that no unit kept gradients it never averaged across replicas."""
        if self.deferred is not None and self.deferred.pending:
            closure = self.deferred.after(closure, model)
        if not self.nonfinite.enabled and self.commit is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        loss = self._wrap_closure(model, optimizer, closure)
        if self.commit is not None and not self.commit():  # a replica group failed inside it: no group steps
            return loss
        if not self.nonfinite.enabled:
            return optimizer.step(**kwargs)
        norm = self.last_grad_norm
        if model.trainer.gradient_clip_val is None:  # not clipped: nothing measured the norm yet
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norm = global_grad_norm(params, self.device_mesh, self.flattened_dims, self.counted_elsewhere)
        device = loss.device if isinstance(loss, torch.Tensor) else (norm.device if norm is not None else "cpu")
        if not self.nonfinite.step_is_finite(loss, norm, model.trainer.global_step, torch.device(device)):
            return loss
        return optimizer.step(**kwargs)
