"""A model the run's end keeps sharded (:func:`cuboid.dropin.after_run.stays_sharded`: pipeline, context or expert
parallel, activation checkpointing, offloaded shards, tensor parallel applied by the user's ``configure_model``, or
whole weights too big for the host) still answers a library's own calls after ``fit``.

- A method other than ``forward`` (scvi-tools' ``module.inference``, a ``loss`` or ``generate`` the library calls):
  only ``forward`` goes through FSDP2's hooks, so such a method would meet sharded DTensors beside plain inputs.
  Each such method of the model's modules runs as it is first, and when it meets a sharded weight once more
  gathered (:func:`serve_calls`): the units that hold the module's parameters are unsharded with FSDP2's public
  ``FSDPModule.unshard``, the method runs, and they are sharded again. That second run is a collective over the
  units' meshes, as a forward is: every rank makes it. Under pipeline parallel a rank holds only its stages: a
  call that fails there is refused by name instead.
- A ``state_dict()`` a plain module can load: :func:`whole_state_dict` (every rank calls it), whole CPU tensors under
  the model's own names, every pipeline stage's included. ``module.state_dict()`` itself keeps giving the shards (a
  caller on one rank only must not wait on the others).

The next ``fit``, ``validate`` or ``test`` takes the wrappers away first (:func:`release_calls`): inside a run only
FSDP2's own hooks gather.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from cuboid import compat
from cuboid.dropin.averaging import whole_weights

_WRAPPERS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()  # what release_calls takes away
_STAGES: weakref.WeakKeyDictionary[nn.Module, tuple[dist.ProcessGroup, list[str]]] = weakref.WeakKeyDictionary()
_FOREIGN = ("torch.", "lightning.", "pytorch_lightning.", "lightning_fabric.", "torchmetrics.")
_calling = threading.local()  # a gathered call under way on this thread: the methods it calls run as they are


def library_methods(module: nn.Module) -> Iterator[str]:
    """The public methods ``module``'s class and its bases define beyond torch's and Lightning's (whose names a
    ``LightningModule`` or ``nn.Module`` has, Lightning's hooks among them, are left to Lightning), ``forward``
    excepted: the calls a library makes that FSDP2's hooks do not see."""
    mro = type(module).__mro__
    theirs = {name for cls in mro if _foreign(cls) for name in vars(cls)}  # Lightning's hooks, nn.Module's own
    seen: set[str] = set()
    for cls in (c for c in mro if not _foreign(c)):
        for name, value in vars(cls).items():
            if name in seen or name in theirs or name.startswith("_") or name == "forward":
                continue
            seen.add(name)
            if (
                callable(value)
                and not isinstance(value, (staticmethod, classmethod, type))
                and name not in vars(module)
            ):
                yield name  # (an instance's own, e.g. a step method FSDP2 registered, is left as it is)


def _foreign(cls: type) -> bool:
    return cls.__module__.startswith(_FOREIGN) or cls.__module__ == "builtins"


def serve_calls(
    root: nn.Module, refusal: str | None = None, stages: tuple[dist.ProcessGroup, list[str]] | None = None
) -> list[str]:
    """Wrap each library method of ``root``'s modules (:func:`library_methods`) so that a call after the run
    gathers what it reads when it needs to; with ``refusal`` (why it cannot be gathered: a pipeline split) a call
    that fails raises a ``RuntimeError`` that says so and what to do. ``stages``: under pipeline parallel, the group of the ranks whose
    stages make the model and its parameter names in the model's order, for :func:`whole_state_dict`. Returns the
    wrapped methods, as ``Class.method``."""
    if stages is not None:
        _STAGES[root] = stages
    owner: dict[nn.Module, nn.Module | None] = {}
    _owners(root, None, owner)
    wrapped: list[str] = []
    for module, unit in owner.items():
        names = list(library_methods(module))
        if not names:
            continue
        units = list(dict.fromkeys([*([unit] if unit is not None else []), *compat.fsdp_units(module)]))
        for name in names:
            method = getattr(module, name)
            call = _refused(module, method, refusal) if refusal else _gathered(method, units)
            _WRAPPERS.add(call)
            object.__setattr__(module, name, call)  # an instance attribute: the class stays the user's
            wrapped.append(f"{_user_class(module).__name__}.{name}")
    return list(dict.fromkeys(wrapped))


def release_calls(root: nn.Module) -> None:
    """Take :func:`serve_calls`' wrappers away (before a run: inside it FSDP2's hooks gather)."""
    _STAGES.pop(root, None)
    for module in root.modules():
        for name in [n for n, v in vars(module).items() if callable(v) and v in _WRAPPERS]:
            del module.__dict__[name]


def whole_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with every tensor whole on the CPU, under its own names, that a plain module built
    anew loads with ``load_state_dict``; after a pipeline-parallel run of a LightningModule, every stage's entries
    in the model's order. Works on a plain module too (its tensors copied to the CPU).

    A collective: every rank calls it at the same point (each DTensor is gathered over its mesh; under pipeline
    parallel the stages exchange their parts)."""
    for unit in compat.fsdp_units(module):
        unit.reshard()  # the fp32 shards: never a mixed-precision gathered copy
    raw = module.state_dict()  # a gathered DTensor is a fresh CPU tensor already; a plain one is copied
    state = {k: v.detach() if isinstance(raw[k], DTensor) else v.detach().cpu().clone()
             for k, v in whole_weights(raw).items()}  # fmt: skip
    stages = _STAGES.get(module)
    if stages is None:
        return state
    group, order = stages
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, state, group=group)  # after the run, not in a step: an object collective is fine
    merged = {k: v for part in parts for k, v in part.items()}
    return {**{k: merged[k] for k in order if k in merged}, **merged}


def _owners(module: nn.Module, unit: nn.Module | None, owner: dict[nn.Module, nn.Module | None]) -> None:
    """Each module -> the FSDP unit that holds its own parameters (itself, or its nearest unit above)."""
    here = module if isinstance(module, FSDPModule) else unit
    owner.setdefault(module, here)
    for child in module.children():
        _owners(child, here, owner)


def _gathered(method: Callable[..., Any], units: list[nn.Module]) -> Callable[..., Any]:
    """``method`` run as it is first (most of a library's calls need no weight: a count, a config, a submodule's
    own forward, which FSDP2's hooks gather), and only when it meets a sharded parameter beside a plain tensor
    (DTensor's "mixed" error, :data:`cuboid.compat.MIXED_TENSORS`) once more with ``units`` gathered. A call that
    needs no gathering stays a local call (a caller on one rank alone does not wait on the others)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_calling, "on", False):  # inside an outer call, which gathers for the whole of it
            return method(*args, **kwargs)
        _calling.on = True
        try:
            try:
                return method(*args, **kwargs)
            except RuntimeError as err:
                if compat.MIXED_TENSORS not in str(err):
                    raise
            for unit in units:  # a collective over each unit's mesh, in the same order on every rank
                unit.unshard()  # type: ignore[operator]
            try:
                return method(*args, **kwargs)
            finally:
                for unit in units:
                    unit.reshard()  # type: ignore[operator]
        finally:
            _calling.on = False

    return call


def _user_class(module: nn.Module) -> type:
    """The module's own class, not FSDP2's swapped ``FSDP<Name>``."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _refused(module: nn.Module, method: Callable[..., Any], why: str) -> Callable[..., Any]:
    """``method`` run as it is (one that reads no absent stage works); when it fails, a ``RuntimeError`` that says
    why this rank cannot run it, and what to call instead, raised from its own error."""
    cls, name = _user_class(module).__name__, method.__name__

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as err:
            raise RuntimeError(
                f"{cls}.{name}() after the run: CuboidStrategy keeps the model split ({why}), each rank holding "
                f"only its own stages, so {name}() cannot run on it here ({type(err).__name__}: {err}). Build the "
                "model anew and load cuboid.whole_state_dict(model) into it (every rank calls it), or read a saved "
                "checkpoint with cuboid.read_model_weights(path)."
            ) from err

    return call
