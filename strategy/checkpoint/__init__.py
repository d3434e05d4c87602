"""Checkpoints: the formats (Cuboid's sharded directory and full file, Lightning's strategies'
directories) behind one interface, the checkpointer that saves, loads, links and removes them, resuming,
pretrained weights read per shard, and the export to safetensors or a Hugging Face directory (the reference Llama's
names and config.json mapped to transformers' in ``hf_llama``). A checkpoint lies in a
local directory or anywhere fsspec reaches (``s3://``, ``gs://``, ...: :mod:`cuboid.storage`)."""

from cuboid.checkpoint.checkpointer import FORMATS, Checkpointer
from cuboid.checkpoint.export import main as export_main
from cuboid.checkpoint.export import read_model_weights
from cuboid.checkpoint.format import CheckpointError, CheckpointFormat, CheckpointReader, LoadRequest, SaveRequest
from cuboid.checkpoint.hf_llama import (
    check_hf_config,
    has_hf_name,
    hf_config,
    hf_name,
    llama_shape,
    to_hf_llama,
    to_hf_llama_adapter,
)
from cuboid.checkpoint.hooks import CheckpointHooks
from cuboid.checkpoint.pretrained import PretrainedError
from cuboid.checkpoint.pretrained import load as load_pretrained
from cuboid.checkpoint.pretrained import plan_all as plan_pretrained
from cuboid.checkpoint.resume import DataPosition, restored_names
from cuboid.checkpoint.sharded import CheckpointDamaged, latest_checkpoint

__all__ = [
    "CheckpointDamaged",
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointHooks",
    "CheckpointReader",
    "Checkpointer",
    "DataPosition",
    "FORMATS",
    "LoadRequest",
    "PretrainedError",
    "SaveRequest",
    "check_hf_config",
    "export_main",
    "has_hf_name",
    "hf_config",
    "hf_name",
    "latest_checkpoint",
    "llama_shape",
    "load_pretrained",
    "plan_pretrained",
    "read_model_weights",
    "restored_names",
    "to_hf_llama",
    "to_hf_llama_adapter",
]
