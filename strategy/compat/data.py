"""litdata's internals: where its ``StreamingDataset`` keeps the ranks it deals its chunks over; and where Lightning
seeds DataLoader workers.

litdata deals a ``StreamingDataset`` over every rank of the default process group (``_DistributedEnv.detect()``,
read when the dataset is made), or, made before that group exists, over ``WORLD_SIZE`` and ``GLOBAL_RANK``. Under
tensor, context or pipeline parallel the ranks that must read the same batch are not the data-parallel ranks, and
litdata offers no public way to say so. Checked on litdata 0.2.40; pinned in tests/test_compat.py.

``seed_everything(workers=True)`` sets ``PL_SEED_WORKERS=1`` (its documented effect), and Lightning then gives each
loader ``partial(pl_worker_init_function, rank=global_rank)``: the Trainer after the strategy's
``process_dataloader``, Fabric's ``setup_dataloaders`` before it (an order, not an API). The rank it mixes into the
workers' seeds is the global one, so tensor-, context- and pipeline-parallel peers draw different random crops;
no public argument names another rank. Checked on lightning 2.5.0 and 2.6.6; pinned in tests/test_compat.py.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from lightning.fabric.utilities.seed import pl_worker_init_function


def _is_streaming_dataset(dataset: Any) -> bool:
    return any(
        cls.__module__.startswith("litdata.") and cls.__name__ == "StreamingDataset" for cls in type(dataset).__mro__
    )


def deal_over_data_parallel(dataloader: Any, num_replicas: int, rank: int) -> bool:
    """Make a litdata ``StreamingDataset`` behind ``dataloader`` deal its chunks over the ``num_replicas``
    data-parallel ranks, this one being ``rank``, as Lightning's ``DistributedSampler`` deals a map-style dataset.
    Whether it was one (litdata is not imported otherwise)."""
    dataset = getattr(dataloader, "dataset", None)
    if dataset is None or not _is_streaming_dataset(dataset):
        return False
    from litdata.utilities.env import _DistributedEnv

    found = dataset.distributed_env
    nodes = found.num_nodes if found.num_nodes > 0 and num_replicas % found.num_nodes == 0 else 1
    if (found.world_size, found.global_rank, found.num_nodes) != (num_replicas, rank, nodes):
        dataset.distributed_env = _DistributedEnv(world_size=num_replicas, global_rank=rank, num_nodes=nodes)
        dataset.shuffler = None  # its length and chunks follow the ranks: made again from the new ones
    return True


def seed_workers_by_data_rank(dataloader: Any, data_rank: int) -> Any:
    """Seed ``dataloader``'s worker processes by this rank's data-parallel rank, not its global rank, where
    Lightning would seed them (``seed_everything(workers=True)``): tp, cp and pp peers then draw the same random
    crops and augmentations, and data-parallel ranks still different ones. Lightning's own worker seeding
    (``pl_worker_init_function``) with the rank swapped; a ``worker_init_fn`` of the user's own is left alone.
    Returns ``dataloader``."""
    found = getattr(dataloader, "worker_init_fn", _MISSING)
    if found is _MISSING:
        return dataloader
    lightnings = isinstance(found, partial) and found.func is pl_worker_init_function  # Fabric adds it before
    if lightnings or (found is None and int(os.environ.get("PL_SEED_WORKERS", 0))):  # the Trainer after
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=data_rank)
    return dataloader


_MISSING = object()


def wrapped_sampler(dataloader: Any) -> tuple[Any, Any] | None:
    """``(wrapper, the sampler it wraps)`` when Lightning put its ``DistributedSamplerWrapper`` into ``dataloader``
    (in its ``sampler``, or in the sampler of a batch sampler that auto-collation built): Lightning keeps the
    sampler it wrapped in the wrapper's ``dataset._sampler`` (lightning/fabric/utilities/distributed.py,
    ``_DatasetSamplerWrapper``; checked on lightning 2.5.0 and 2.6.6, pinned in tests/test_compat.py)."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    for holder in (getattr(dataloader, "batch_sampler", None), dataloader):
        wrapper = getattr(holder, "sampler", None)
        if isinstance(wrapper, DistributedSamplerWrapper):
            return wrapper, getattr(wrapper.dataset, "_sampler", None)
    return None


def batch_per_sample(dataloader: Any) -> None:
    """Turn ``dataloader``'s automatic batching off in place: each element its sampler yields is one batch, as
    ``DataLoader(..., batch_size=None)`` builds it (no batch sampler; ``default_convert`` in place of
    ``default_collate`` unless the loader has its own ``collate_fn``). torch refuses these attributes once a
    loader is made (``DataLoader.__setattr__`` while ``_DataLoader__initialized``; torch 2.13
    torch/utils/data/dataloader.py), and a library's loader class cannot always be made again with them (its
    ``__init__`` decides them): the flag is lowered for the change and raised again. Pinned in tests/test_compat.py."""
    from torch.utils.data._utils.collate import default_collate, default_convert

    collate = default_convert if dataloader.collate_fn is default_collate else dataloader.collate_fn
    sampler = dataloader.batch_sampler.sampler
    object.__setattr__(dataloader, "_DataLoader__initialized", False)
    try:
        dataloader.batch_size, dataloader.batch_sampler, dataloader.drop_last = None, None, False
        dataloader.sampler, dataloader.collate_fn = sampler, collate
    finally:
        object.__setattr__(dataloader, "_DataLoader__initialized", True)


def train_data(trainer: Any) -> Any:
    """The training data as this fit will ask for it: the loaders given to ``fit``, or the datamodule's or the
    module's ``train_dataloader()`` (called once more). Lightning keeps where they come from in
    ``trainer.fit_loop._data_source`` (private; no public accessor before the loop has set its data up). Used by
    ``layout="auto"`` for one batch to measure the step on."""
    return trainer.fit_loop._data_source.dataloader()


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on a DataLoader's sampler (and its batch sampler's), once each: what Lightning does at each
    epoch start (its ``_set_sampler_epoch``)."""
    seen: dict[int, Any] = {}
    for sampler in (
        getattr(dataloader, "sampler", None),
        getattr(getattr(dataloader, "batch_sampler", None), "sampler", None),
    ):
        if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
            seen[id(sampler)] = sampler
    for sampler in seen.values():
        sampler.set_epoch(epoch)


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """The train ``dataloader`` made again with ``sampler``, as Lightning re-makes a loader to inject its
    ``DistributedSampler`` (its ``_update_dataloader``: the loader's own class and arguments, a custom batch
    sampler's class kept)."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
