"""The pipeline wing: splitting a model into stages, the runner that replays a LightningModule's own step hooks
per microbatch, the step's results on every rank, and :class:`Pipelining`, the strategy's pipeline."""

from cuboid.pipeline.pipelining import Pipelining, batch_and_index
from cuboid.pipeline.stages import MULTI_STAGE, SCHEDULES, PipelineError, find_pipeline_split, split_batch

__all__ = [
    "MULTI_STAGE",
    "SCHEDULES",
    "PipelineError",
    "Pipelining",
    "batch_and_index",
    "find_pipeline_split",
    "split_batch",
]
