"""Data and tensor parallel: the device mesh, tensor-parallel plans and styles, and how a model is parallelized
(TP -> activation checkpointing -> compile -> FSDP2) and its weights materialized."""

from cuboid.parallel.batchnorm import DataParallelBatchNorm, sync_batchnorm
from cuboid.parallel.buffers import BufferBroadcast
from cuboid.parallel.build import ParallelSettings, finish_weights, parallelize_plain, prepare_weights
from cuboid.parallel.dims import ParallelDims
from cuboid.parallel.mesh import (
    FLATTENED,
    MESH_NAMES,
    Layout,
    LayoutError,
    build_device_mesh,
    check_reshard_after_forward,
    dim_groups,
    fsdp_mesh,
    submesh,
)
from cuboid.parallel.parallelize import (
    ACMode,
    ExpertsLayout,
    apply_ac,
    apply_compile,
    apply_fsdp,
    apply_tp,
    check_ac_mode,
    check_no_fsdp1,
    is_parallelized_by_user,
    parallelize,
)
from cuboid.parallel.plans import (
    find_blocks,
    find_model_plan,
    match_plan,
    resolve_plan,
    with_loss_parallel,
    without_loss_parallel,
)
from cuboid.parallel.styles import PlanError, canonical_style, check_plan_styles

__all__ = [
    "ACMode",
    "BufferBroadcast",
    "DataParallelBatchNorm",
    "ExpertsLayout",
    "FLATTENED",
    "Layout",
    "LayoutError",
    "MESH_NAMES",
    "ParallelDims",
    "ParallelSettings",
    "PlanError",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "apply_tp",
    "build_device_mesh",
    "canonical_style",
    "check_ac_mode",
    "check_no_fsdp1",
    "check_plan_styles",
    "check_reshard_after_forward",
    "dim_groups",
    "find_blocks",
    "find_model_plan",
    "finish_weights",
    "fsdp_mesh",
    "is_parallelized_by_user",
    "match_plan",
    "parallelize",
    "parallelize_plain",
    "prepare_weights",
    "resolve_plan",
    "submesh",
    "sync_batchnorm",
    "with_loss_parallel",
    "without_loss_parallel",
]
