"""Data and tensor parallel: the device mesh, tensor-parallel plans and styles, and how a model is parallelized
(TP -> activation checkpointing -> compile -> FSDP2) and its weights materialized. Exported: what users and the
other wings use; the rest is read from its module (``cuboid.parallel.parallelize.apply_tp``, ...)."""

from cuboid.dropin import BufferBroadcast  # (DDP's broadcast_buffers: a drop-in concern, named here too)
from cuboid.parallel.batchnorm import DataParallelBatchNorm, sync_batchnorm
from cuboid.parallel.build import (
    ParallelSettings,
    finish_weights,
    parallelize_plain,
    prepare_weights,
)
from cuboid.parallel.mesh import (
    FLATTENED,
    MESH_NAMES,
    Layout,
    LayoutError,
    ParallelDims,
    check_reshard_after_forward,
    dim_groups,
    submesh,
)
from cuboid.parallel.parallelize import (
    ACMode,
    check_no_fsdp1,
    is_parallelized_by_user,
)
from cuboid.parallel.plans import (
    find_blocks,
    resolve_plan,
    with_loss_parallel,
    without_loss_parallel,
)
from cuboid.parallel.settings import BuildSettings, parse_bytes
from cuboid.parallel.styles import PlanError, canonical_style

__all__ = [
    "parse_bytes",
    "ACMode",
    "BufferBroadcast",
    "BuildSettings",
    "DataParallelBatchNorm",
    "FLATTENED",
    "Layout",
    "LayoutError",
    "MESH_NAMES",
    "ParallelDims",
    "ParallelSettings",
    "PlanError",
    "canonical_style",
    "check_no_fsdp1",
    "check_reshard_after_forward",
    "dim_groups",
    "find_blocks",
    "finish_weights",
    "is_parallelized_by_user",
    "parallelize_plain",
    "prepare_weights",
    "resolve_plan",
    "submesh",
    "sync_batchnorm",
    "with_loss_parallel",
    "without_loss_parallel",
]
