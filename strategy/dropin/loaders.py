"""The loaders a library builds for Lightning's DDP, under Cuboid's layout.

A library built on Lightning often builds its data path from what the strategy is (scvi-tools:
``isinstance(strategy, DDPStrategy)``), and Cuboid passes as Lightning's DDP for that question
(:mod:`cuboid.dropin.replicated`). What a loader does then is checked here, in ``process_dataloader``, for every
layout:

- :func:`check_sampler_ranks`: a ``DistributedSampler`` the library made itself (over the world's ranks, as it does
  for DDP) must deal over Cuboid's data-parallel ranks; under tensor, context or pipeline parallel the world's ranks
  are not those, and a loader dealing over them would feed peers different samples. Refused by name, with the
  arguments that would work.
- :func:`keep_library_batches`: a loader whose *sampler* yields whole batches, automatic batching off
  (``batch_size=None``: scvi-tools' ``AnnDataLoader`` passes a ``BatchSampler`` as ``sampler=``), made again by
  Lightning around its ``DistributedSamplerWrapper`` through the library's own ``__init__``, which then leaves torch's
  default ``batch_size=1``: every minibatch batched once more (``[1, 64, genes]`` for ``[64, genes]``), a silent
  change under Lightning's DDP too. Cuboid turns automatic batching off again, so each rank reads the library's
  batches, dealt over the data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from cuboid import compat


class LoaderError(ValueError):
    """A loader that would feed Cuboid's layout other samples than it reads them: what is wrong and what to do."""


def check_sampler_ranks(dataloader: Any, num_replicas: int, rank: int, any_rank: bool, layout: str) -> None:
    """Refuse ``dataloader`` if a ``DistributedSampler`` in it (its sampler, its batch sampler or the batch sampler's
    sampler) deals over other ranks than the ``num_replicas`` data-parallel ranks, this one ``rank``. ``any_rank``:
    the layout is data-parallel only, so any rank of the right count is one of the data-parallel ranks."""
    holders = (getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None))
    for sampler in (*holders, getattr(holders[1], "sampler", None)):
        if not isinstance(sampler, DistributedSampler):
            continue
        if sampler.num_replicas == num_replicas and (any_rank or sampler.rank == rank):
            continue
        raise LoaderError(
            f"The loader's {type(sampler).__name__} deals its samples over {sampler.num_replicas} replicas (this "
            f"process as replica {sampler.rank}), but Cuboid's layout {layout} has {num_replicas} data-parallel ranks "
            f"(this process is data-parallel rank {rank}): tensor-, context- and pipeline-parallel peers must read the "
            f"same samples. Build the sampler with `**trainer.strategy.distributed_sampler_kwargs` "
            f"(num_replicas={num_replicas}, rank={rank}), or leave the sampler to Lightning. A library that builds it "
            f"for DDP on its own trains under Cuboid's data-parallel-only layouts (the default, or data_parallel_shard)."
        )


def yields_batches(sampler: Any) -> bool:
    """Whether ``sampler`` yields lists of indices (a batch sampler) rather than indices."""
    if isinstance(sampler, BatchSampler):
        return True
    return isinstance(getattr(sampler, "batch_size", None), int) and not isinstance(sampler, DistributedSampler)


def keep_library_batches(dataloader: Any) -> bool:
    """Turn automatic batching off again in a library's loader that Lightning made again around a sampler yielding
    whole batches (this module's docstring). torch's own ``DataLoader`` keeps its ``batch_size`` through Lightning's
    re-making, so a ``batch_size`` of 1 there is the project's own and is left alone. Whether it changed anything."""
    if type(dataloader) is DataLoader or not isinstance(dataloader, DataLoader):
        return False
    found = compat.wrapped_sampler(dataloader)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if found is None or type(batch_sampler) is not BatchSampler or batch_sampler.sampler is not found[0]:
        return False
    if dataloader.batch_size != 1 or not yields_batches(found[1]):
        return False
    compat.batch_per_sample(dataloader)
    rank_zero_info(
        f"Cuboid: {type(dataloader).__name__}'s sampler ({type(found[1]).__name__}) yields whole batches with automatic "
        "batching off; Lightning's re-made loader had batched each of them again (batch_size=1): automatic batching is "
        "off again, the library's batches dealt over the data-parallel ranks"
    )
    return True
