"""The parallel wing: the device mesh, tensor-parallel plans and styles, and how a model is parallelized
(TP -> activation checkpointing -> compile -> FSDP2) and its weights materialized."""

from cuboid.parallel.batchnorm import DataParallelBatchNorm, convert_batchnorm, sync_batchnorm
from cuboid.parallel.buffers import BufferBroadcast
from cuboid.parallel.build import ParallelSettings, finish_weights, parallelize_plain, prepare_weights
from cuboid.parallel.mesh import DP_DIMS, MESH_NAMES, Layout, LayoutError, build_device_mesh, fsdp_mesh, submesh
from cuboid.parallel.parallelize import ACMode, apply_ac, apply_compile, apply_fsdp, apply_tp, parallelize
from cuboid.parallel.plans import find_blocks, find_model_plan, match_plan, resolve_plan
from cuboid.parallel.styles import PlanError

__all__ = [
    "ACMode",
    "BufferBroadcast",
    "DataParallelBatchNorm",
    "DP_DIMS",
    "Layout",
    "LayoutError",
    "MESH_NAMES",
    "ParallelSettings",
    "PlanError",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "apply_tp",
    "build_device_mesh",
    "convert_batchnorm",
    "find_blocks",
    "find_model_plan",
    "finish_weights",
    "fsdp_mesh",
    "match_plan",
    "parallelize",
    "parallelize_plain",
    "prepare_weights",
    "resolve_plan",
    "submesh",
    "sync_batchnorm",
]
