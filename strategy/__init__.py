"""Cuboid: a PyTorch Lightning strategy for pp x dp x tp training on one device mesh.

``from cuboid import CuboidStrategy``; importing ``cuboid`` also registers
``Trainer(strategy="cuboid")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from cuboid.checkpoint_glue import latest_checkpoint
from cuboid.mesh import Layout, LayoutError
from cuboid.plans import PlanError
from cuboid.precision import CuboidPrecision
from cuboid.strategy import CuboidStrategy

if CuboidStrategy.strategy_name not in StrategyRegistry:
    CuboidStrategy.register_strategies(StrategyRegistry)

__all__ = ["CuboidPrecision", "CuboidStrategy", "Layout", "LayoutError", "PlanError", "latest_checkpoint"]
__version__ = "0.1.0"
