"""A job's life outside the training step: launching, stopping together on preemption and requeueing,
the dead-rank watchdog, hung collectives, even batches across ranks, the same batch on tp/cp/pp peers, the run
directory's lock, and :class:`JobGuard`, which the strategy holds."""

from cuboid.job.even_batches import UnevenBatchesError
from cuboid.job.guard import JobGuard
from cuboid.job.launch import (
    CuboidLauncher,
    adopt_elastic_round,
    check_before_launch,
    check_external_launch,
    forget_previous_launch,
    pod_environment,
    prepare_launch,
    start_process_group,
)
from cuboid.job.peer_batches import PeerBatchesDiffer
from cuboid.job.run_lock import RunDirectoryBusy

__all__ = [
    "CuboidLauncher",
    "JobGuard",
    "adopt_elastic_round",
    "PeerBatchesDiffer",
    "RunDirectoryBusy",
    "UnevenBatchesError",
    "check_before_launch",
    "check_external_launch",
    "forget_previous_launch",
    "pod_environment",
    "prepare_launch",
    "start_process_group",
]
