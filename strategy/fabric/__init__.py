"""Lightning Fabric's door: ``Fabric(strategy=cuboid.fabric.CuboidStrategy(...))`` (or ``strategy="cuboid"``), the Trainer's
mesh, plans, sharding and checkpoints for a loop the user writes (``docs/fabric.md``)."""

from cuboid.fabric.precision import FabricPrecision
from cuboid.fabric.strategy import CuboidStrategy

__all__ = ["CuboidStrategy", "FabricPrecision"]
