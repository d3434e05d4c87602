"""Data parallel by replication where sharding buys nothing: DDP's own all-reduce for a model that fits each device.

Sharding a model that fits every device whole costs an all-gather of its weights before each unit's forward and
backward, and saves memory the device does not need: a small dense network or a recurrent one ran about 2x slower
per step under FSDP2 (sharded, or replicated through FSDP2's own HSDP) than under DDP on the 2-core CPU machine. So
when the layout is left to Cuboid (``data_parallel_shard`` left unset, nothing but data parallel asked for) and the
model, its gradients and its optimizer state (16 bytes a parameter: fp32 weights, gradients and Adam's two
moments) take at most a quarter of what each process has (device memory on a GPU, host memory over the node's
ranks on CPU), Cuboid replicates the model with torch's ``DistributedDataParallel`` over the data-parallel group
(bucketed all-reduces overlapped with backward, buffers broadcast from the first rank, ``no_sync`` while gradients
accumulate, as Lightning's DDP strategy runs it), and writes one-file checkpoints that DDP-era code reads
(``Model.load_from_checkpoint(path)``, ``torch.load(path)["state_dict"]``). A larger model is sharded with FSDP2, as
an explicit ``data_parallel_shard`` always is. Setup says which, on what figures, and how to force the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and Adam's two moments
ROOM = 4  # replicate when that takes at most a quarter of what a process has (activations need the rest)


@dataclass(frozen=True)
class Replication:
    """Whether the default data-parallel layout replicates the model (``replicate``), and why, in a sentence."""

    replicate: bool
    reason: str


def choose_replication(
    module: nn.Module, device: torch.device, local_processes: int, sizes: dict[str, int], **asked: Any
) -> Replication:
    """The default data-parallel layout for ``module`` on ``device`` (``local_processes`` on its node), given the
    other degrees (``sizes``, by argument name) and what else asks for sharding (``asked``, by name)."""
    refused = refusal(module, sizes, **asked)
    if refused is None and device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        refused = "sync_batchnorm on CPU (torch's DDP takes SyncBatchNorm layers on GPUs only)"
    return choose(module, capacity(device, local_processes), refused)


def choose(module: nn.Module, capacity: float | None, refused: str | None) -> Replication:
    """Replicate ``module`` when its training state fits a quarter of ``capacity`` (bytes a process has; None:
    unknown, shard) and nothing asks for sharding (``refused``: what does, or None)."""
    params = sum(p.numel() for p in module.parameters())
    need = params * BYTES_PER_PARAMETER
    figures = f"{params:,} parameters: {_size(need)} of weights, gradients and Adam state"
    if refused is not None:
        return Replication(False, f"sharded (FSDP2): {refused}")
    if capacity is None:
        return Replication(False, f"sharded (FSDP2): {figures}, and the memory each process has is unknown")
    share = f"{figures} against {capacity / 2**30:.1f} GiB each process has"
    if need * ROOM <= capacity:
        return Replication(True, f"replicated, as DDP does ({share}: fits whole with room to spare). "
                                 "data_parallel_shard='auto' shards it instead")  # fmt: skip
    return Replication(False, f"sharded (FSDP2) ({share}: more than a quarter). data_parallel_shard=1 with "
                              "data_parallel_replicate=N replicates it instead")  # fmt: skip


def first_asked(sizes: dict[str, int], asked: dict[str, Any]) -> str | None:
    """The degrees other than data parallel that are set (``"tensor_parallel=2, pipeline_parallel=2"``), else the
    first setting that is set, by name, else None."""
    others = [f"{name}={value}" for name, value in sizes.items() if value != 1]
    return ", ".join(others) if others else next((name for name, value in asked.items() if value), None)


def refusal(module: nn.Module, sizes: dict[str, int], **asked: Any) -> str | None:
    """What asks for sharding, in words, or None: another degree than data parallel, a replica group, offload,
    pretrained weights read per shard, or a model built on the meta device (made shard by shard)."""
    found = first_asked(sizes, asked)
    if found is not None:
        return f"{found} asked for"
    if any(p.is_meta for p in module.parameters()):
        return "the model is built on the meta device (made shard by shard)"
    return None


def replicate_module(
    module: nn.Module, group: Any, device: torch.device, find_unused: bool = True
) -> DistributedDataParallel:
    """``module`` under torch's ``DistributedDataParallel`` over ``group`` (its weights and buffers from the group's
    first rank, as DDP starts). ``find_unused``: DDP looks for parameters a step leaves without a gradient (a walk of
    the autograd graph each step): on at first, as no model fails with it (pytorch-forecasting's TFT has such
    parameters, which plain DDP refuses); off once a step has shown there are none (:func:`has_unused_parameters`:
    the strategy drops the first DDP, whose reducer takes its hooks with it, and wraps the module again)."""
    module.to(device)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, process_group=group, find_unused_parameters=find_unused)


def has_unused_parameters(model: DistributedDataParallel, group: Any, device: torch.device) -> bool:
    """After a step: whether a trainable parameter of any rank got no gradient (one all-reduce, one host read)."""
    import torch.distributed as dist

    unused = [p.grad is None for p in model.module.parameters() if p.requires_grad]
    flag = torch.tensor(float(any(unused)), device=device)
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


def capacity(device: torch.device, local_processes: int) -> float | None:
    """Bytes each process has: the device's memory on a GPU, the host's over the node's processes on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, local_processes)
    return None


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
