"""While gradients accumulate: which data-parallel reductions wait for the optimizer step's last microbatch.

Under HSDP (``data_parallel_replicate > 1``) FSDP2 reduces each unit's gradients in two collectives: a reduce-scatter
within the replica's shard group, then an all-reduce across the replicas. With ``accumulate_grad_batches=k`` (the
Trainer enters :meth:`DeferredReductions.accumulating` on the microbatches before the last) or Fabric's
``no_backward_sync``, ``CuboidStrategy(defer_reductions=...)`` chooses:

* ``"replicas"`` (default): FSDP2's ``set_requires_all_reduce(False)``. Each microbatch still reduce-scatters; FSDP
  adds the result into one flat buffer per unit (the shard's size, in the reduce dtype) and the last microbatch
  all-reduces the sum once: one all-reduce per unit and optimizer step instead of k, the same memory, the same
  gradients (the reduction is linear). Plain FSDP has no all-reduce: nothing changes there.
* ``"all"``: ``set_requires_gradient_sync(False)`` (FSDP1's ``no_sync``): neither collective until the last
  microbatch. Meanwhile each rank keeps every parameter's unsharded gradient (its tensor-parallel slice): the
  sharded gradients' memory times ``dp_shard``, in the reduce dtype.
* ``None``: every microbatch reduces both.

A replicated model (DDP) skips its all-reduce with DDP's ``no_sync`` unless ``None``. Under pipeline parallel torch's
schedule sets these flags at every step itself: nothing is deferred across Lightning's batches there. Deferring
assumes each unit's gradients on the last microbatch cover the parameters of the earlier ones (true of dense and
packed-expert models): a unit left with unreduced gradients after the last backward is refused by name before the
optimizer steps (a host check of FSDP's state, no device work).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

from torch import nn

from cuboid import compat

DeferMode = Literal["replicas", "all"]
MODES: tuple[DeferMode | None, ...] = ("replicas", "all", None)


class DeferredReductions:
    """``defer_reductions`` for one strategy (see the module docstring); ``hsdp``: its FSDP mesh spans replicas;
    ``pipelined``: pipeline parallel (both from the strategy's degrees)."""

    def __init__(self, mode: DeferMode | None = "replicas", hsdp: bool = False, pipelined: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(
                f"defer_reductions={mode!r}: choose 'replicas' (HSDP's all-reduce once per optimizer step), 'all' "
                "(no reduction until the step's last microbatch: unsharded gradients kept meanwhile) or None "
                "(every microbatch reduces)."
            )
        self.mode = mode
        self.hsdp = hsdp
        self.pipelined = pipelined
        self._deferred: list[nn.Module] = []  # units left with their all-reduce pending by the last window

    @contextmanager
    def accumulating(
        self, module: nn.Module | None, ddp_no_sync: Callable[[], AbstractContextManager[Any]] | None = None
    ) -> Generator[None, None, None]:
        """Within: ``module``'s backward defers what ``mode`` says (``ddp_no_sync``: the Trainer's own ``no_sync``
        for a model under DDP, entered unless ``mode`` is None)."""
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if self.mode is None or module is None:
            yield
            return
        if isinstance(module, DistributedDataParallel):
            with ddp_no_sync() if ddp_no_sync is not None else module.no_sync():
                yield
            return
        if self.pipelined or (self.mode == "replicas" and not self.hsdp):  # the schedule's own; plain FSDP's none
            yield
            return
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        setter = "set_requires_all_reduce" if self.mode == "replicas" else "set_requires_gradient_sync"
        for unit in units:
            getattr(unit, setter)(False, recurse=False)
        self._deferred = units if self.mode == "replicas" else []
        try:
            yield
        finally:
            for unit in units:
                getattr(unit, setter)(True, recurse=False)

    @property
    def pending(self) -> bool:
        """Units deferred their all-reduce in this optimizer step's earlier microbatches."""
        return bool(self._deferred)

    def after(self, closure: Callable[[], Any], module: nn.Module) -> Callable[[], Any]:
        """``closure`` (the step's last forward and backward), then :meth:`check_reduced`."""

        def run() -> Any:
            result = closure()
            self.check_reduced(module)
            return result

        return run

    def check_reduced(self, module: nn.Module) -> None:
        """After the optimizer step's last backward: refuse a unit whose deferred gradients were never all-reduced
        across the replicas (it got no gradient on that microbatch), by name."""
        if not self._deferred:
            return
        units, self._deferred = self._deferred, []
        names = {id(m): name or "the root" for name, m in module.named_modules()}
        left = [names.get(id(unit), type(unit).__name__) for unit in units if compat.fsdp_unreduced(unit)]
        if left:
            raise RuntimeError(
                f"defer_reductions='replicas': {', '.join(left)} got gradients on earlier microbatches of this "
                "optimizer step but none on its last, so they were never averaged across the replicas. Set "
                "CuboidStrategy(defer_reductions=None) for a model whose units skip parameters from one microbatch "
                "to the next."
            )
