"""Which Lightning package Cuboid serves: ``lightning`` (``lightning.pytorch``, ``lightning.fabric``), the standalone
``pytorch_lightning`` and ``lightning_fabric``, or both, from one source.

``import cuboid`` runs :func:`install`: ``Trainer(strategy="cuboid")`` and ``Fabric(strategy="cuboid")`` then work
with either package's classes (:mod:`cuboid.packages.registry`), and ``cuboid.pytorch_lightning`` is Cuboid for the
standalone packages (:mod:`cuboid.packages.mirror`): ``from cuboid.pytorch_lightning import CuboidStrategy`` is a
``pytorch_lightning.strategies.Strategy``, as ``from cuboid import CuboidStrategy`` is a ``lightning.pytorch`` one.
Where only the standalone packages are installed, ``cuboid`` is ``cuboid.pytorch_lightning`` under its own name.
This module imports neither package.
"""

from __future__ import annotations

import importlib.util
import sys

from cuboid.packages.mirror import MIRROR, MirrorFinder, rewrite
from cuboid.packages.registry import AfterImport, register_everywhere

__all__ = ["MIRROR", "install", "installed", "rewrite"]


def installed() -> tuple[str, ...]:
    """The Lightning packages this environment has, of ``lightning`` and ``pytorch_lightning``, found without
    importing them."""

    def present(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, a broken install
            return False

    return tuple(name for name in ("lightning", "pytorch_lightning") if present(name))


def install() -> str:
    """Put Cuboid's finders on ``sys.meta_path`` (once) and register ``"cuboid"`` in the strategy registries of
    the packages already imported (the others as they are imported). Returns the package ``cuboid``'s own names
    are built for: ``"lightning"``, or ``"pytorch_lightning"`` where ``lightning`` is not installed.

    Raises ``ImportError`` naming both packages when neither is installed."""
    for finder in sys.meta_path:
        if isinstance(finder, MirrorFinder):
            return "lightning" if not finder.alias else "pytorch_lightning"
    packages = installed()
    if not packages:
        raise ImportError(
            "Cuboid runs inside PyTorch Lightning, and neither of its packages is installed: no `lightning` and no "
            "`pytorch_lightning`. Install one (`pip install lightning`, which brings `pytorch_lightning` with it)."
        )
    alias = "lightning" not in packages
    sys.meta_path[:0] = [MirrorFinder(alias=alias), AfterImport()]
    register_everywhere()
    return "pytorch_lightning" if alias else "lightning"
