"""Cuboid: a PyTorch Lightning strategy for pp x dp x cp x tp training on one device mesh.

``from cuboid import CuboidStrategy``; importing ``cuboid`` also registers ``Trainer(strategy="cuboid")`` and
``Fabric(strategy="cuboid")`` (``cuboid.fabric.CuboidStrategy``, Fabric's door), for ``lightning`` and for the
standalone ``pytorch_lightning`` and ``lightning_fabric`` alike. A project written against ``pytorch_lightning``
passes ``cuboid.pytorch_lightning.CuboidStrategy``: the same source built for that package (:mod:`cuboid.packages`).

This module holds the names most users import. Each part of Cuboid (``cuboid.parallel``, ``cuboid.pipeline``,
``cuboid.context``, ``cuboid.experts``, ``cuboid.checkpoint``, ``cuboid.job``, ``cuboid.step``, ``cuboid.planning``,
``cuboid.fabric``) lists its own in ``__all__``; ``docs/architecture.md`` shows how they fit together.
"""

# ruff: noqa: E402  (install() runs before the first module that imports Lightning)
import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from cuboid.packages import install

install()  # before any module that imports Lightning: the registries, and cuboid.pytorch_lightning

from cuboid.callbacks import CommLedger, CuboidMonitor
from cuboid.checkpoint import CheckpointDamaged, CheckpointError, PretrainedError, latest_checkpoint, read_model_weights
from cuboid.context import ContextParallelError
from cuboid.dropin import LoaderError, whole_state_dict
from cuboid.experts import ExpertParallelError
from cuboid.job import PeerBatchesDiffer, RunDirectoryBusy, UnevenBatchesError
from cuboid.parallel import Layout, LayoutError, PlanError
from cuboid.pipeline import PipelineError
from cuboid.replicas import FaultTolerance
from cuboid.step import CuboidPrecision, NonFiniteError
from cuboid.strategy import CuboidStrategy

__all__ = [
    "LoaderError",
    "CheckpointDamaged",
    "CheckpointError",
    "CommLedger",
    "ContextParallelError",
    "ExpertParallelError",
    "FaultTolerance",
    "CuboidMonitor",
    "CuboidPrecision",
    "CuboidStrategy",
    "Layout",
    "LayoutError",
    "NonFiniteError",
    "PeerBatchesDiffer",
    "PipelineError",
    "PlanError",
    "PretrainedError",
    "RunDirectoryBusy",
    "UnevenBatchesError",
    "latest_checkpoint",
    "read_model_weights",
    "whole_state_dict",
]


def __getattr__(name: str) -> Any:
    """``cuboid.models`` (the reference models, which the library itself never imports) is imported when first
    asked for, as ``import cuboid.models`` would."""
    if name == "models":
        return importlib.import_module(f"{__name__}.models")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:
    __version__ = version("cuboid")  # the installed distribution's, wheel or editable
except PackageNotFoundError:  # the source tree imported without an install
    __version__ = "0.0.0+unknown"
