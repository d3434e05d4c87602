"""Which modules of a LightningModule become FSDP units, so that whatever a DDP project trains, trains.

FSDP2 gathers a unit's parameters around its ``forward`` (and methods registered with
``register_fsdp_forward_method``), and ``fully_shard`` swaps the module's class. So a unit is a module that

- has a ``forward`` (a ``ModuleDict``/``ModuleList`` has none: ``fully_shard`` refuses it; its children may be units),
- whose class can be swapped (``fully_shard`` cannot for a class with a C-level layout of its own, such as some
  ``nn.LSTM`` subclasses: ``__class__ assignment ... object layout differs``),
- and that the LightningModule's own code calls through ``forward`` only (a step that calls ``self.model.loss(...)``,
  gluonts' does, would meet its parameters sharded).

Blocks (the repeated layers the plans find) are units; so is each top-level child of the LightningModule that meets
the three rules. Everything else stays with the LightningModule itself, which is the root unit: its parameters are
gathered for the whole step (``training_step``, ``validation_step``, ``test_step``, ``predict_step`` are its forward
methods), as Lightning's DDP and FSDP strategies route each step through the wrapped module's ``forward``; their
gradients are reduce-scattered as any unit's. Setup says in one line what it kept whole, and why.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache

from torch import nn

from cuboid import compat

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_FRAMEWORKS = ("lightning", "pytorch_lightning", "torch")  # their methods are not the project's own code


def has_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class implements ``forward`` (containers such as ``ModuleDict`` do not)."""
    return type(module).forward is not nn.Module.forward


def class_swappable(module: nn.Module) -> bool:
    """Whether ``fully_shard`` can swap ``module``'s class for its FSDP subclass: tried (and undone) on a subclass
    made the way it makes one."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    probe = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})  # as fully_shard makes it
    try:
        module.__class__ = probe
    except TypeError:
        return False
    module.__class__ = cls
    return True


@cache
def _nn_module_api() -> frozenset[str]:
    return frozenset(name for name in dir(nn.Module) if not name.startswith("__"))


def methods_called_on_children(module: nn.Module) -> dict[str, set[str]]:
    """Top-level child -> the methods other than ``forward`` (and ``nn.Module``'s own: ``parameters``, ``train``,
    ...) that ``module``'s own code calls on it (``self.<child>.<method>(...)``), read from the source of its classes
    below Lightning's and torch's."""
    children = {name for name, _ in module.named_children()}
    found: dict[str, set[str]] = {}
    for cls in type(module).__mro__:
        if cls is object or cls.__module__.split(".")[0] in _FRAMEWORKS:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner, method = node.func.value, node.func.attr
            if (
                isinstance(owner, ast.Attribute)
                and isinstance(owner.value, ast.Name)
                and owner.value.id == "self"
                and owner.attr in children
                and method not in _nn_module_api()
            ):
                found.setdefault(owner.attr, set()).add(method)
    return found


def choose_units(
    module: nn.Module, blocks: Sequence[tuple[str, nn.Module]]
) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The top-level units of ``module`` (``(name, child)``, outside any block; blocks are units of their own), and a
    note for each module kept whole in ``module``'s own unit: ``"name (why)"``."""
    block_names = {name for name, _ in blocks}
    called = methods_called_on_children(module)
    units: list[tuple[str, nn.Module]] = []
    kept: list[str] = []

    def visit(prefix: str, parent: nn.Module, top: bool) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if path in block_names or not any(True for _ in child.parameters()):
                continue
            if not has_forward(child):
                units_before = len(units)
                visit(f"{path}.", child, False)
                inner = len(units) - units_before + sum(f"{path}.{n}" in block_names for n, _ in child.named_children())
                kept.append(f"{path} ({type(child).__name__}: a container without forward"
                            f"{f'; {inner} of its children are units' if inner else ''})")  # fmt: skip
            elif top and name in called:
                methods = ", ".join(f"{m}()" for m in sorted(called[name]))
                kept.append(f"{path} (the step calls its {methods}, not forward)")
            elif not class_swappable(child):
                kept.append(f"{path} ({type(child).__name__}: fully_shard cannot swap its class)")
            else:
                units.append((path, child))

    visit("", module, True)
    return units, kept


class FreedWeightsError(RuntimeError):
    """A forward that differentiates through sharded units itself: what happened and what to do."""


@contextmanager
def explain_freed_weights(module: nn.Module) -> Iterator[None]:
    """Around the step's backward: torch's error when a unit's gathered weights were freed under the graph that
    still needs them, said for what it is. A forward that calls ``torch.autograd.grad(..., create_graph=True)``
    through sharded units (a force field's forces from its energy, a gradient penalty) runs their backward hooks
    inside the forward: FSDP2 reshards each unit there and frees its gathered weights, which the outer backward
    then reads (torch 2.13: "setStorage: ... out of bounds for storage of size 0"; with
    ``reshard_after_backward`` off, no gradient reaches the shards instead). Lightning's DDP all-reduces whole
    gradients and is not touched by it."""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        if (
            "setStorage" not in text
            or "storage of size 0" not in text
            or not any(True for _ in compat.fsdp_units(module))
        ):
            raise
        raise FreedWeightsError(
            "The backward reached weights FSDP2 had already freed: the model's forward differentiates through its "
            "sharded layers itself (torch.autograd.grad(..., create_graph=True), as a force field computes forces "
            "from its energy, or a gradient penalty), which runs FSDP2's backward hooks inside the forward and frees "
            "each unit's gathered weights before the step's backward. Train it replicated: leave data_parallel_shard "
            "unset (Cuboid replicates a model that fits with torch's DDP, which this forward trains under)."
        ) from err
