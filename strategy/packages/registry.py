"""``strategy="cuboid"`` in all four strategy registries: ``lightning.pytorch``, ``lightning.fabric``,
``pytorch_lightning`` and ``lightning_fabric``.

Each package keeps its own registry, read when a ``Trainer`` or ``Fabric`` is built. Cuboid registers a small
factory in each one as soon as both it and that package are imported, in either order: at ``import cuboid`` for the
packages already there, and otherwise right after the package's ``strategies`` module runs (:class:`AfterImport`).
The factory imports the strategy class only when a Trainer asks for it, so a ``lightning`` project never builds
``cuboid.pytorch_lightning``, and the other way round.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cuboid.packages.doors import CONNECTORS, guard

NAME = "cuboid"
# registry module -> (its registry's attribute, the class a factory builds: module, attribute, description)
REGISTRIES: dict[str, tuple[str, str, str, str]] = {
    "lightning.pytorch.strategies": ("StrategyRegistry", "cuboid", "CuboidStrategy", "Cuboid for the Trainer"),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", "cuboid.fabric", "CuboidStrategy", "Cuboid for Fabric"),
    "pytorch_lightning.strategies": (
        "StrategyRegistry", "cuboid.pytorch_lightning", "CuboidStrategy", "Cuboid for pytorch_lightning's Trainer"
    ),
    "lightning_fabric.strategies": (
        "STRATEGY_REGISTRY", "cuboid.pytorch_lightning.fabric", "CuboidStrategy", "Cuboid for lightning_fabric's Fabric"
    ),
}  # fmt: skip


def factory(module: str, attribute: str) -> Callable[..., Any]:
    """``strategy="cuboid"``'s entry: builds ``module.attribute(**kwargs)`` when a Trainer or Fabric asks."""

    def cuboid_strategy(**kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attribute)(**kwargs)

    cuboid_strategy.__qualname__ = f"{module}.{attribute}"
    return cuboid_strategy


def register(strategies: ModuleType) -> None:
    """Add ``"cuboid"`` to the registry of ``strategies`` (one of :data:`REGISTRIES`' modules), once."""
    attribute, module, cls, description = REGISTRIES[strategies.__name__]
    registry = getattr(strategies, attribute, None)
    if registry is not None and NAME not in registry:
        registry.register(NAME, factory(module, cls), description=description)


class _Then(importlib.abc.Loader):
    """A loader that runs another, then ``then(module)``."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, get_resource_reader, ...
        return getattr(self.loader, name)


class AfterImport(importlib.abc.MetaPathFinder):
    """Registers Cuboid in a package's strategy registry right after that package's ``strategies`` module runs,
    and guards its connector's door right after the connector's module runs (:mod:`cuboid.packages.doors`)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        then = register if fullname in REGISTRIES else guard if fullname in CONNECTORS else None
        if then is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Then(spec.loader, then)
                return spec
        return None


def register_everywhere() -> None:
    """Register in the registries already imported (an :class:`AfterImport` on ``sys.meta_path`` takes the others
    as they are imported)."""
    for name in REGISTRIES:
        module = sys.modules.get(name)
        if module is not None:
            register(module)
    for name in CONNECTORS:  # and each package's door checks a Cuboid strategy's package (cuboid.packages.doors)
        module = sys.modules.get(name)
        if module is not None:
            guard(module)
