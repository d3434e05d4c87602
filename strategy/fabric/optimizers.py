"""The optimizer side of a Fabric loop under Cuboid: optimizers made before ``fabric.setup`` follow the sharded
parameters, optimizers made from the wrong parameters are refused, and ``fabric.no_backward_sync`` defers FSDP2's
reductions on accumulation steps as ``defer_reductions`` says."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager, nullcontext

from torch import nn
from torch.optim import Optimizer

from cuboid.step import DeferredReductions


@contextmanager
def optimizers_follow(module: nn.Module, optimizers: Sequence[Optimizer]) -> Generator[None, None, None]:
    """Within: ``module`` is parallelized (its parameters replaced by sharded ones); after: each optimizer's
    parameter groups hold the new parameters, matched by name. An optimizer that already holds state is refused."""
    for optimizer in optimizers:
        if any(optimizer.state.values()):
            raise RuntimeError(
                "fabric.setup(model, optimizer): the optimizer already holds state for the unsharded parameters. "
                "Create it from model.parameters() after model = fabric.setup(model) (then "
                "fabric.setup_optimizers(optimizer)), or before any step."
            )
    names = {id(p): name for name, p in module.named_parameters()}
    yield
    params = dict(module.named_parameters())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [params[names[id(p)]] if id(p) in names else p for p in group["params"]]


def check_optimizer(optimizer: Optimizer, module: nn.Module) -> None:
    """Refuse an optimizer that holds parameters other than ``module``'s own (sharded) ones."""
    owned = {id(p) for p in module.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in owned)
    if foreign:
        raise RuntimeError(
            f"The optimizer holds {foreign} parameter(s) that are not the set-up model's: it was created from "
            "model.parameters() before fabric.setup(model) sharded them. Create it after setup, or pass it "
            "with the model: model, optimizer = fabric.setup(model, optimizer)."
        )


class NoGradientSync:
    """``fabric.no_backward_sync(model)``: the reductions ``defer_reductions`` names wait for the step that steps
    the optimizer (:mod:`cuboid.step.accumulation`)."""

    def __init__(self, deferred: DeferredReductions) -> None:
        self.deferred = deferred

    @contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Generator[None, None, None]:
        with self.deferred.accumulating(module) if enabled else nullcontext():
            yield
