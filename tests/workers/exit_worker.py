"""Ends right after many asynchronous gloo collectives whose tensors Python has already dropped: the exit race
that ``cuboid.job.launch.close_process_groups`` closes. With ``cuboid`` as the argument, Cuboid's exit handler is
registered (what CuboidStrategy's setup does); with ``bare``, the process exits as torch leaves it.

Usage: torchrun --nproc-per-node 2 exit_worker.py cuboid|bare
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from cuboid.job.launch import destroy_process_group_at_exit

dist.init_process_group("gloo")
if sys.argv[1] == "cuboid":
    destroy_process_group_at_exit()
for _ in range(2000):
    dist.all_reduce(torch.ones(4), async_op=True)  # neither the work nor its tensor kept
dist.barrier()
