"""litdata's internals: where its ``StreamingDataset`` keeps the ranks it deals its chunks over.

litdata deals a ``StreamingDataset`` over every rank of the default process group (``_DistributedEnv.detect()``,
read when the dataset is made), or, made before that group exists, over ``WORLD_SIZE`` and ``GLOBAL_RANK``. Under
tensor, context or pipeline parallel the ranks that must read the same batch are not the data-parallel ranks, and
litdata offers no public way to say so. Checked on litdata 0.2.40; pinned in tests/test_compat.py.
"""

from __future__ import annotations

from typing import Any


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
