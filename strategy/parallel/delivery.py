"""Sending rank 0's weights to the ranks that hold them, and to no other.

Without pipeline parallelism every rank holds a slice of every tensor (a data-parallel shard, a tensor-parallel
piece, or the whole), so each tensor goes to the world. Under pipeline parallelism a stage's ranks hold only their
stages' tensors: each tensor goes to the stages that hold it (two, for a tied embedding and head on the first and
last stage), over one process group per stage made of rank 0 and that stage's ranks, so no rank receives a block it
does not keep. Which stages hold which tensor is agreed once, by one all-gather of a flag per tensor per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor


def deliver(
    value: torch.Tensor | None, like: torch.Tensor, targets: list[torch.Tensor], device: torch.device, group: Any = None
) -> None:
    """Broadcast one full tensor from rank 0 (``value``; ``None`` elsewhere) over ``group`` (the world when None) and
    copy each rank's slice of it into ``targets`` (this rank's tensors of that name: a DTensor shard, a plain
    tensor, or none)."""
    buf = value.to(device) if value is not None else torch.empty(like.shape, dtype=like.dtype, device=device)
    if dist.is_initialized():
        dist.broadcast(buf, src=0, group=group)
    for target in targets:
        if isinstance(target, DTensor):
            local = distribute_tensor(buf, target.device_mesh, target.placements, src_data_rank=None).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(buf)


class Delivery:
    """Where each of a list of tensors goes, then sending them one by one (see the module docstring).

    Every rank makes one with the same mesh, calls :meth:`plan` with its flags for the same tensors in the same
    order, then :meth:`send` for each, and :meth:`close` at the end (the stage groups are freed)."""

    def __init__(self, mesh: DeviceMesh | None, device: torch.device) -> None:
        self.device = device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.stages: list[tuple[set[int], Any]] | None = None
        self.holders: list[set[int]] = []
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        if mesh is not None and dist.is_initialized() and "pp" in names and mesh["pp"].size() > 1:
            rows = mesh.mesh.reshape(mesh["pp"].size(), -1).tolist()
            self.stages = [
                (set(members), dist.new_group(sorted({0, *members}), group_desc=f"cuboid_weights_stage{s}"))
                for s, members in enumerate(rows)
            ]

    def plan(self, held: list[bool]) -> None:
        """Agree which stages hold each tensor: ``held[i]`` says whether this rank keeps any of tensor ``i``."""
        if self.stages is None or not held:
            return
        mine = torch.tensor(held, dtype=torch.uint8, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        rows = torch.stack(everyone).cpu().tolist()
        stage_of = {r: s for s, (members, _) in enumerate(self.stages) for r in members}
        self.holders = [{stage_of[r] for r, row in enumerate(rows) if row[i]} for i in range(len(held))]

    def send(self, index: int, value: torch.Tensor | None, like: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Tensor ``index`` of the plan: rank 0's full ``value`` (None on other ranks) to the ranks that hold it,
        each copying its slice into its ``targets``."""
        if self.stages is None:
            deliver(value, like, targets, self.device)
            return
        for stage in sorted(self.holders[index]):
            members, group = self.stages[stage]
            if self.rank in members or self.rank == 0:
                deliver(value, like, targets if self.rank in members else [], self.device, group)

    def close(self) -> None:
        """Free the stage groups."""
        for _, group in self.stages or []:
            dist.destroy_process_group(group)
        self.stages = None
