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
