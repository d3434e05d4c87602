"""What a DDP project's model needs to switch by one line: the FSDP units ``fully_shard`` can take as they are, the
rest gathered with the LightningModule for each step (``units``), and replication with torch's own DDP where
sharding buys nothing (``replicate``: the default data-parallel layout follows memory); the loaders a library
builds for DDP, checked against the layout (``loaders``); weight averaging beside a sharded model (``averaging``);
DDP's ``broadcast_buffers`` (``buffers``)."""

from cuboid.dropin.averaging import (
    AveragingError,
    accept_whole_state_dicts,
    check_averaging,
    shard_alike,
    whole_weights,
)
from cuboid.dropin.buffers import BufferBroadcast
from cuboid.dropin.kept import release_calls, serve_calls, whole_state_dict
from cuboid.dropin.loaders import LoaderError, check_sampler_ranks, keep_library_batches
from cuboid.dropin.replicate import (
    Replication,
    capacity,
    choose,
    choose_replication,
    has_unused_parameters,
    refusal,
    replicate_module,
)
from cuboid.dropin.replicated import Replicating
from cuboid.dropin.units import STEP_METHODS, FreedWeightsError, choose_units, explain_freed_weights

__all__ = [
    "BufferBroadcast",
    "AveragingError",
    "accept_whole_state_dicts",
    "shard_alike",
    "whole_weights",
    "check_averaging",
    "LoaderError",
    "release_calls",
    "serve_calls",
    "whole_state_dict",
    "check_sampler_ranks",
    "keep_library_batches",
    "STEP_METHODS",
    "FreedWeightsError",
    "explain_freed_weights",
    "Replicating",
    "Replication",
    "capacity",
    "choose",
    "choose_replication",
    "choose_units",
    "has_unused_parameters",
    "refusal",
    "replicate_module",
]
