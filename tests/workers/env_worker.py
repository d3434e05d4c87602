"""Prints what a rank sees: its rank variables, sys.argv, sys.path[0], the working directory, __main__'s file, and
Lightning's rank-zero flag, then joins a gloo group and all-reduces its rank."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

dist.init_process_group("gloo")
total = torch.tensor(float(dist.get_rank()))
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
seen = {k: os.environ.get(k) for k in keys}
seen.update(argv=sys.argv[1:], path0=sys.path[0], cwd=os.getcwd(), main=__file__, zero=rank_zero_only.rank,
            total=float(total))  # fmt: skip
os.write(1, ("SEEN " + json.dumps(seen) + "\n").encode())  # one write: the ranks share one output
dist.destroy_process_group()
