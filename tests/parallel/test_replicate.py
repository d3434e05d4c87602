"""The default data-parallel layout follows memory (cuboid.dropin.replicate): a model whose weights, gradients and
Adam state fit a quarter of what each process has is replicated as DDP does; a larger one, or one that asks for
sharding otherwise, is sharded. The figures it was chosen on, and how to force the other, are said."""

from __future__ import annotations

import torch
from torch import nn

from cuboid.dropin import choose, choose_replication, refusal

GIB = 2**30


def _on_meta(params: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(params // 1024, 1024, bias=False)


def test_a_model_that_fits_with_room_to_spare_is_replicated() -> None:
    small = nn.Linear(1000, 1000)  # 1M parameters: 16 MB of training state
    choice = choose(small, capacity=12 * GIB, refused=None)
    assert (
        choice.replicate
        and "replicated, as DDP does" in choice.reason
        and "data_parallel_shard='auto'" in choice.reason
    )
    assert "1,001,000 parameters: 15.3 MiB" in choice.reason and "12.0 GiB each process has" in choice.reason


def test_an_llm_layouts_default_still_shards_by_the_memory_rule() -> None:
    """An 8B model on an 80 GiB GPU: 128 GB of weights, gradients and Adam state, more than a quarter (more than
    the whole): sharded. A 1B one there (16 GB, a fifth) would be replicated, as DDP trains it."""
    eight_b, one_b = _on_meta(8 * 1024**3), _on_meta(1024**3)
    sharded = choose(eight_b, capacity=80 * GIB, refused=None)
    assert not sharded.replicate and "sharded (FSDP2)" in sharded.reason and "more than a quarter" in sharded.reason
    assert "data_parallel_shard=1 with data_parallel_replicate=N replicates it" in sharded.reason
    assert choose(one_b, capacity=80 * GIB, refused=None).replicate
    assert not choose(nn.Linear(10, 10), capacity=None, refused=None).replicate  # unknown memory: shard


def test_what_asks_for_sharding_is_named() -> None:
    small = nn.Linear(8, 8)
    assert refusal(small, {"tensor_parallel": 2, "pipeline_parallel": 1}) == "tensor_parallel=2 asked for"
    assert refusal(small, {}, cpu_offload=True) == "cpu_offload asked for"
    assert refusal(_on_meta(2048), {}) == "the model is built on the meta device (made shard by shard)"
    assert refusal(small, {"tensor_parallel": 1}, cpu_offload=False, pretrained={}) is None
    choice = choose(small, capacity=12 * GIB, refused="tensor_parallel=2 asked for")
    assert not choice.replicate and choice.reason == "sharded (FSDP2): tensor_parallel=2 asked for"


def test_synced_batchnorm_on_cpu_is_sharded() -> None:
    """torch's DDP takes ``SyncBatchNorm`` layers (``Trainer(sync_batchnorm=True)`` converts to such) on GPUs only:
    on CPU the default shards them, with why."""
    model = nn.Sequential(nn.Linear(8, 8), nn.SyncBatchNorm(8))
    choice = choose_replication(model, torch.device("cpu"), 2, {})
    assert not choice.replicate and "sync_batchnorm on CPU" in choice.reason
    assert choose_replication(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), torch.device("cpu"), 2, {}).replicate
