"""Context parallel: each sequence split over cp ranks (load-balanced for causal attention), exact
attention across the shards, and a user's unchanged step run on them (inputs, attention, loss)."""

from cuboid.context.attention import (
    ContextParallelError,
    chunk_ids,
    cp_attention,
    gather_sequence,
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from cuboid.context.current import KEY_PADDING, active
from cuboid.context.runtime import ContextParallel, positions_keyword

__all__ = [
    "ContextParallel",
    "ContextParallelError",
    "KEY_PADDING",
    "active",
    "chunk_ids",
    "cp_attention",
    "gather_sequence",
    "local_positions",
    "positions_keyword",
    "shard_sequence",
    "unshard_sequence",
]
