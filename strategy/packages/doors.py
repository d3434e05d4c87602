"""A Cuboid strategy handed to the other package's Trainer or Fabric is refused with Cuboid's own message.

``lightning.pytorch`` and ``pytorch_lightning`` have their own ``Strategy`` classes: ``cuboid.CuboidStrategy`` is
a ``lightning.pytorch`` one and ``cuboid.pytorch_lightning.CuboidStrategy`` a ``pytorch_lightning`` one (the same
source, :mod:`cuboid.packages.mirror`). A ``pytorch_lightning.Trainer(strategy=cuboid.CuboidStrategy())`` would stop
at the package's own "invalid strategy name" error, which says nothing of the twin. So, as each package's connector
module is imported, the connector's ``__init__`` (``_AcceleratorConnector`` for the Trainer, ``_Connector`` for
Fabric: what a ``Trainer``/``Fabric`` passes ``strategy=`` to, by keyword) first checks a Cuboid strategy's package
(:func:`check_door`), and raises a ``TypeError`` naming the class to pass and ``strategy="cuboid"``. This module
imports neither package; ``tests/test_packages.py`` pins the two private names.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

# connector module -> (its class, the package its strategies belong to, what the door is)
CONNECTORS: dict[str, tuple[str, str, str]] = {
    "lightning.pytorch.trainer.connectors.accelerator_connector": ("_AcceleratorConnector", "lightning.pytorch",
                                                                   "lightning.pytorch.Trainer"),
    "pytorch_lightning.trainer.connectors.accelerator_connector": ("_AcceleratorConnector", "pytorch_lightning",
                                                                   "pytorch_lightning.Trainer"),
    "lightning.fabric.connector": ("_Connector", "lightning.fabric", "lightning.fabric.Fabric"),
    "lightning_fabric.connector": ("_Connector", "lightning_fabric", "lightning_fabric.Fabric"),
}  # fmt: skip
# (package a strategy is built for) -> the Cuboid class built for it
TWINS = {
    "lightning.pytorch": "cuboid.CuboidStrategy",
    "pytorch_lightning": "cuboid.pytorch_lightning.CuboidStrategy",
    "lightning.fabric": "cuboid.fabric.CuboidStrategy",
    "lightning_fabric": "cuboid.pytorch_lightning.fabric.CuboidStrategy",
}


def built_for(strategy: Any) -> str | None:
    """The Lightning package a Cuboid strategy object belongs to (a key of :data:`TWINS`), or None for anything
    that is not a Cuboid strategy."""
    cls = type(strategy)
    if cls.__module__.split(".")[0] != "cuboid":
        return None
    for base in cls.__mro__:
        for package in TWINS:
            if base.__module__.startswith(package + "."):
                return package
    return None


def check_door(package: str, door: str, strategy: Any) -> None:
    """Raise a ``TypeError`` when ``strategy`` is a Cuboid strategy built for another package than ``package``
    (``door``: the class it was handed to, for the message)."""
    mine = built_for(strategy)
    if mine is None or mine == package:
        return
    raise TypeError(
        f"{door}(strategy={TWINS[mine]}(...)): that CuboidStrategy is built for `{mine}`, and a {door} takes the "
        f"strategies of `{package}` only. Pass {TWINS[package]}(...) instead (the same class built for `{package}`, "
        'the same arguments), or strategy="cuboid".'
    )


def guard(module: ModuleType) -> None:
    """Wrap the connector of ``module`` (one of :data:`CONNECTORS`) so that it checks the strategy first, once."""
    attribute, package, door = CONNECTORS[module.__name__]
    cls = getattr(module, attribute, None)
    if cls is None or getattr(cls.__init__, "__cuboid_door__", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        check_door(package, door, kwargs.get("strategy"))
        original(self, *args, **kwargs)

    __init__.__cuboid_door__ = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
