"""Pipeline parallel: cutting a model into stages (a Hugging Face decoder as it is, or a model written for Cuboid's
contract), the runner that replays a LightningModule's own step hooks per microbatch, the step's results on every
rank, and :class:`Pipelining`, the strategy's pipeline."""

from cuboid.pipeline.pipelining import Pipelining, batch_and_index
from cuboid.pipeline.runner import PipelineRunner
from cuboid.pipeline.stages import (
    MULTI_STAGE,
    SCHEDULES,
    PipelineError,
    default_microbatches,
    find_pipeline_split,
    split_batch,
    stage_blocks,
    stage_ids,
)

__all__ = [
    "MULTI_STAGE",
    "PipelineError",
    "PipelineRunner",
    "Pipelining",
    "SCHEDULES",
    "batch_and_index",
    "default_microbatches",
    "find_pipeline_split",
    "split_batch",
    "stage_blocks",
    "stage_ids",
]
