"""Will this layout fit on the device? Checked twice in ``CuboidStrategy.setup``, on GPUs.

1. Before any parameter is materialized or sharded: :func:`estimate` counts, from the unsharded module (meta
   tensors count as well as real ones), the parameter bytes each rank will hold after sharding: this pp rank's
   stages (the same split the pipeline makes), divided by tp for the modules the tensor-parallel plan shards and
   by dp_shard as FSDP2 chunks dim 0. :func:`refuse_if_too_big` refuses the layout when those parameters and as
   many gradients exceed the device, with the estimate, what an Adam-like optimizer adds, and how many GPUs the
   shard group would need (``data_parallel_shard="auto"`` says what it filled).
2. After the optimizers exist: :func:`check_fits` with the measured shards and the optimizer's own state.

Activations come on top and depend on the batch: ``python -m cuboid.layout`` (:mod:`cuboid.planning.planner`) estimates
them for Llama-shaped models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cuboid.parallel import Layout, LayoutError, canonical_style

# Styles that split a module's weight over tp, and the weight dim they split (Linear, Embedding).
_TP_DIM: dict[str, tuple[int, int]] = {
    "colwise": (0, 1), "output": (0, 1), "loss_parallel": (0, 1), "embedding_colwise": (1, 1),
    "rowwise": (1, 0), "rowwise_split_input": (1, 0), "rowwise_sequence": (1, 0),
    "embedding": (0, 0), "embedding_sequence": (0, 0),
}  # fmt: skip
_COLWISE = ("colwise", "output", "loss_parallel")  # their bias is split too; a rowwise bias stays whole


@dataclass(frozen=True)
class Estimate:
    """Parameter bytes per rank, by pp rank (the largest dp/tp shard of its stages), before sharding."""

    per_pp_rank: list[int]
    unsharded_per_pp_rank: list[int]  # the same stages before FSDP (tp still applied): what one dp rank would hold

    def rank_bytes(self, pp_rank: int) -> int:
        return self.per_pp_rank[pp_rank]


def _fmt(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


def _tp_split(matched: Mapping[str, tuple[nn.Module, str]], tp: int) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (tp divisor, the dim it splits) for the parameters the plan shards."""
    out: dict[int, tuple[int, int]] = {}
    if tp == 1:
        return out
    for module, style in matched.values():
        name = canonical_style(style)
        if name not in _TP_DIM:
            continue
        linear_dim, embedding_dim = _TP_DIM[name]
        weight_dim = embedding_dim if isinstance(module, nn.Embedding) else linear_dim
        for pname, param in module.named_parameters(recurse=False):
            if pname == "weight" and param.dim() >= 2:
                out[id(param)] = (tp, weight_dim)
            elif pname == "bias" and name in _COLWISE:
                out[id(param)] = (tp, 0)
    return out


def _local_elements(param: torch.Tensor, split: tuple[int, int] | None, dp_shard: int) -> int:
    """Elements of the largest dp shard: tp splits ``split``'s dim, FSDP2 chunks dim 0 (``torch.chunk``)."""
    shape = list(param.shape) or [1]
    if split is not None:
        divisor, dim = split
        shape[dim] = math.ceil(shape[dim] / divisor)
    shape[0] = math.ceil(shape[0] / dp_shard)
    return math.prod(shape)


def _pp_owned(lm: nn.Module, blocks: Sequence[tuple[str, nn.Module]], pipelining: Any) -> list[list[str]] | None:
    """Per pp rank, the name prefixes (from ``lm``) of what its stages hold; None without pipeline parallel."""
    if not pipelining.enabled:
        return None
    from cuboid.pipeline import find_pipeline_split, stage_blocks, stage_ids

    split = find_pipeline_split(lm, blocks)
    n_stages = pipelining.pp * pipelining.virtual_stages
    per_stage = stage_blocks(len(split.block_keys), n_stages, pipelining.split)
    owned = []
    for rank in range(pipelining.pp):
        stages = stage_ids(rank, pipelining.pp, pipelining.virtual_stages, pipelining.schedule)
        prefixes = [f"{split.owner}.{split.container}.{split.block_keys[i]}." for s in stages for i in per_stage[s]]
        prefixes += [f"{split.owner}.{n}." for n in split.pre] if 0 in stages else []
        prefixes += [f"{split.owner}.{n}." for n in split.post] if n_stages - 1 in stages else []
        owned.append(prefixes)
    return owned


def estimate(
    lm: nn.Module,
    layout: Layout,
    matched: Mapping[str, tuple[nn.Module, str]],
    blocks: Sequence[tuple[str, nn.Module]],
    pipelining: Any,
    param_bytes: int | None = None,
) -> Estimate:
    """Parameter bytes each pp rank's largest shard will hold, from the unsharded ``lm`` (meta or real).

    ``param_bytes``: bytes per element after the precision plugin converts the module (``None``: each parameter's
    own dtype). Parameters outside every stage under pipeline parallel, and the LightningModule's own, stay whole.
    """
    tp_split = _tp_split(matched, layout.tp)
    owned = _pp_owned(lm, blocks, pipelining)
    n_ranks = layout.pp if owned is not None else 1
    per, unsharded = [0] * n_ranks, [0] * n_ranks
    direct = {id(p) for p in lm.parameters(recurse=False)}
    seen: list[set[int]] = [set() for _ in range(n_ranks)]
    for name, param in lm.named_parameters(remove_duplicate=False):
        size = param_bytes or param.element_size()
        split = tp_split.get(id(param))
        for rank in range(n_ranks):
            if id(param) in seen[rank]:
                continue
            staged = owned is not None and name.startswith(tuple(owned[rank]))
            other_stage = owned is not None and not staged and any(name.startswith(tuple(o)) for o in owned)
            if other_stage:
                continue
            seen[rank].add(id(param))
            whole = id(param) in direct or (owned is not None and not staged)  # left outside every FSDP unit
            per[rank] += size * _local_elements(param, split, 1 if whole else layout.dp_shard * layout.cp)
            unsharded[rank] += size * _local_elements(param, split, 1)
    return Estimate(per, unsharded)


def refuse_if_too_big(est: Estimate, layout: Layout, capacity: float, auto: bool) -> None:
    """Refuse, before any parameter is materialized, a layout whose parameters and as many gradients on some rank
    exceed ``capacity`` bytes (the device's memory). The optimizer's state is not known yet: the message says what
    an Adam-like one adds, and how large a shard group would hold it all."""
    worst = max(range(len(est.per_pp_rank)), key=est.rank_bytes)
    params = est.rank_bytes(worst)
    if 2 * params <= capacity:
        return
    rest = layout.pp * layout.dp_replicate * layout.tp * layout.cp  # FSDP shards over dp_shard x cp
    need = {k: math.ceil(k * est.unsharded_per_pp_rank[worst] / capacity / layout.cp) for k in (2, 4)}
    where = f" (pipeline stage rank {worst}, the largest)" if layout.pp > 1 else ""
    filled = (
        f"data_parallel_shard='auto' filled {layout.dp_shard} (the world {layout.dp_shard * rest} / "
        f"(pipeline_parallel x data_parallel_replicate x context_parallel x tensor_parallel = {rest})). "
        if auto
        else ""
    )
    raise LayoutError(
        f"The layout {layout.describe()} cannot fit: each rank{where} would hold {_fmt(params)} of parameter shards "
        f"and as many gradients, {_fmt(2 * params)} before any optimizer state or activation ({_fmt(4 * params)} "
        f"with an Adam-like optimizer's two moments), but the device has {_fmt(capacity)}. {filled}Parameters and "
        f"gradients alone need data_parallel_shard >= {need[2]} ({need[2] * rest} GPUs at this pp x dp_replicate x "
        f"tp), with Adam >= {need[4]} ({need[4] * rest} GPUs). Shard wider (more GPUs, a larger tensor_parallel or "
        "pipeline_parallel), use cpu_offload=True, or precision='bf16-true'; python -m cuboid.layout model=... "
        "estimates activations too. Nothing was allocated."
    )


def device_bytes(device: torch.device, cpu_offload: bool) -> float | None:
    """Bytes a rank's parameters, gradients and optimizer state may take on its device (a GPU's total memory);
    None where nothing is checked: on CPU, and with CPU offload (they live on the host)."""
    if device.type != "cuda" or cpu_offload:
        return None
    return float(torch.cuda.get_device_properties(device).total_memory)


def _moments(optimizer: object) -> int:
    """Full-size state tensors per parameter: Adam-like 2, SGD with momentum 1, plain SGD 0 (others: 2)."""
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if optimizer.defaults.get("momentum", 0) else 0
    return 2


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (a DTensor's local shard, else the tensor)."""
    from torch.distributed.tensor import DTensor

    t = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return t.numel() * t.element_size()


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds, measured: its parameter shards, their gradients (those that exist now) and the
    optimizer's tensor state (step counters left out), in bytes."""
    params = sum(local_nbytes(p) for p in module.parameters())
    grads = sum(local_nbytes(p.grad) for p in module.parameters() if p.grad is not None)
    state = sum(local_nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    return {"params": params, "grads": grads, "optim": state}


def check_fits(module: nn.Module, optimizers: list, capacity: float, what: str) -> float:
    """Refuse a layout whose persistent bytes on this rank (its parameter shards, as many gradients, and the
    optimizers' full-size states) exceed ``capacity`` (the device's memory) before the first step, with the
    numbers and the ways out; returns those bytes. Activations come on top and depend on the batch: see
    ``python -m cuboid.layout``."""
    params = sum(local_nbytes(p) for p in module.parameters())
    moments = max((_moments(o) for o in optimizers), default=0)
    persistent = params * (2 + moments)
    if persistent > capacity:
        raise LayoutError(
            f"{what} cannot fit: each rank holds {_fmt(persistent)} of parameter shards, gradients and optimizer "
            f"state ({_fmt(params)} of parameters x {2 + moments}) before any activation, but the device has "
            f"{_fmt(capacity)}. Shard wider (more GPUs, a larger data_parallel_shard or tensor_parallel), use "
            "cpu_offload=True, or precision='bf16-true'; python -m cuboid.layout model=... lists the layouts "
            "that fit."
        )
    return persistent
