"""The checkpoint wing: the formats (Cuboid's sharded directory and full file, Lightning's strategies'
directories) behind one interface, the checkpointer that saves, loads, links and removes them, resuming,
pretrained weights read per shard, and the export to safetensors or a Hugging Face directory."""

from cuboid.checkpoint.checkpointer import FORMATS, READERS, Checkpointer
from cuboid.checkpoint.export import read_model_weights
from cuboid.checkpoint.format import CheckpointError, CheckpointFormat, CheckpointReader, LoadRequest, SaveRequest
from cuboid.checkpoint.pretrained import PretrainedError
from cuboid.checkpoint.resume import latest_checkpoint

__all__ = [
    "FORMATS",
    "READERS",
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointReader",
    "Checkpointer",
    "LoadRequest",
    "PretrainedError",
    "SaveRequest",
    "latest_checkpoint",
    "read_model_weights",
]
