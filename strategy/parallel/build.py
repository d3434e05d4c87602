"""The plain build of a LightningModule (no pipeline), and the weight handling every build shares.

The strategy decides the route (torchtitan's ``train.py`` pattern): without pipeline parallelism
:func:`parallelize_plain` shards the whole LightningModule; with it, the pipeline code keeps this rank's stages
and calls :func:`cuboid.parallel.parallelize.parallelize` on each. Either way, weights are prepared before
(:func:`prepare_weights`: what was built for real gets rank 0's values, what was built on meta keeps a meta twin
for rank 0's init, pretrained sources are checked) and filled after (:func:`finish_weights`), once sharded.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from cuboid import compat
from cuboid.checkpoint import load_pretrained, plan_pretrained
from cuboid.dropin import accept_whole_state_dicts, choose_units
from cuboid.parallel import materialize, plans
from cuboid.parallel.mesh import ExpertsLayout, fsdp_mesh
from cuboid.parallel.parallelize import ACMode, Part, parallelize
from cuboid.parallel.settings import BuildSettings


@dataclass(frozen=True)
class ParallelSettings:
    """Everything :func:`~cuboid.parallel.parallelize.parallelize` applies besides the tensor-parallel plan."""

    tp_mesh: DeviceMesh
    dp_mesh: DeviceMesh  # what FSDP shards over (dp_shard, with dp_replicate for HSDP)
    mp_policy: MixedPrecisionPolicy
    activation_checkpointing: ACMode | None = None
    compile: bool = False
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    experts: ExpertsLayout | None = None  # expert parallel: the experts' split and their FSDP mesh

    @classmethod
    def on(
        cls, mesh: DeviceMesh, settings: BuildSettings, mp_policy: MixedPrecisionPolicy, experts: ExpertsLayout | None
    ) -> ParallelSettings:
        """What ``settings`` (a strategy's checked record) asks of each block, on ``mesh``'s ``tp`` dimension and its
        FSDP dimensions, with FSDP's ``mp_policy`` and, under expert parallel, the experts' meshes."""
        return cls(
            tp_mesh=mesh["tp"],
            dp_mesh=fsdp_mesh(mesh),
            mp_policy=mp_policy,
            activation_checkpointing=settings.activation_checkpointing,
            compile=settings.compile,
            reshard_after_forward=settings.reshard_after_forward,
            cpu_offload=settings.cpu_offload,
            experts=experts,
        )

    def apply(
        self,
        parts: Sequence[Part],
        tp_root: nn.Module,
        matched: Mapping[str, tuple[nn.Module, str]],
        step_root: nn.Module | None = None,
    ) -> None:
        """Parallelize ``parts`` (FSDP roots with their blocks), the plan ``matched`` naming modules of ``tp_root``;
        ``step_root``: the part root gathered for each whole step (the LightningModule)."""
        parallelize(
            parts,
            tp_root=tp_root,
            tp_plan=plans.parallel_plan(matched, tp_root),
            tp_mesh=self.tp_mesh,
            dp_mesh=self.dp_mesh,
            mp_policy=self.mp_policy,
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            experts=self.experts,
            step_root=step_root,
        )


@dataclass
class Weights:
    """What :func:`prepare_weights` found, for :func:`finish_weights`."""

    sources: list[Any] = field(default_factory=list)  # pretrained plans, checked
    loaded: set[str] = field(default_factory=set)  # names a pretrained source fills
    on_meta: set[str] = field(default_factory=set)  # names built on the meta device
    twins: dict[str, Any] = field(default_factory=dict)  # meta twins for rank 0's init
    restored: set[str] = field(default_factory=set)  # names a checkpoint about to be loaded fills: not initialised
    local: bool = False  # each rank initializes its own shards of what is on meta
    kept: dict[str, Any] = field(default_factory=dict)  # under pp: what was built for real, sent after the split
    made: dict[str, int] = field(default_factory=lambda: {"initialized": 0, "sent": 0})  # pieces rank 0 initialised,
    # tensors sent from rank 0 (what was built for real)


def prepare_weights(
    lm: nn.Module,
    pretrained: Mapping[str, Any] | None,
    device: torch.device,
    *,
    pipelined: bool,
    restored: set[str] = frozenset(),  # type: ignore[assignment]
    local: bool = False,
) -> Weights:
    """Check every pretrained source before any work, keep meta twins, move what was built for real to ``device``
    with rank 0's values on every rank (under pp: kept, to be sent to its stage once split). ``restored``: the names
    a checkpoint about to be loaded fills; they are neither initialised nor sent. ``local``: each rank will initialize
    its own shards of what is on meta (no twins kept)."""
    direct = [n for n, _ in lm.named_parameters(recurse=False)]
    if direct and pipelined:
        raise TypeError(
            f"{type(lm).__name__} holds parameters directly ({direct}); under pipeline parallelism every parameter "
            "must belong to a stage. Move them into the model the LightningModule calls (e.g. self.model)."
        )
    sources = plan_pretrained(lm, pretrained or {})  # every source checked before any work
    loaded = set().union(*(plan.lightning_names() for plan in sources))
    skip = loaded | set(restored)
    on_meta = materialize.meta_names(lm)
    twins = materialize.meta_twins(lm) if on_meta - skip and not local else {}
    materialize.to_device_except_parameters(lm, device)
    weights = Weights(sources, loaded, on_meta, twins, set(restored), local=local)
    if pipelined:  # sent once the stages are split, to the ranks that keep each tensor
        weights.kept = materialize.keep_for_stages(lm, skip)
    else:  # what was built for real: rank 0's values everywhere
        weights.made["sent"] = materialize.broadcast_from_rank0(lm, device, skip=skip)
    return weights


def _lightning_parts(lm: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> tuple[list[Part], nn.Module | None]:
    """The FSDP units of a LightningModule, each with its blocks (:mod:`cuboid.parallel.units`): its top-level
    children that can be units, then, last, the LightningModule itself with the blocks no unit holds (returned too:
    the root unit, gathered for each step). A module that is not a LightningModule (Fabric's holder, never called
    itself) is no unit: its top-level children are. What is kept whole in the root is said in one line."""
    units, kept = choose_units(lm, blocks)
    parts: list[Part] = [(root, [b for b in blocks if b[0].startswith(f"{name}.")]) for name, root in units]
    if not isinstance(lm, LightningModule):
        return parts, None
    held = {id(b) for _, part_blocks in parts for b in part_blocks}
    parts.append((lm, [b for b in blocks if id(b) not in held]))
    if kept:
        rank_zero_info(
            f"Cuboid: kept in the LightningModule's own FSDP unit, gathered for each step: {'; '.join(kept)}"
        )
    return parts, lm


def parallelize_plain(
    lm: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    matched: Mapping[str, tuple[nn.Module, str]],
    settings: ParallelSettings,
) -> None:
    """Without pipeline parallelism: the LightningModule's units (:func:`_lightning_parts`), each with its blocks."""
    parts, step_root = _lightning_parts(lm, blocks)
    settings.apply(parts, lm, matched, step_root)


def finish_weights(
    lm: nn.Module,
    weights: Weights,
    blocks: Sequence[tuple[str, nn.Module]],
    device: torch.device,
    dp_mesh: DeviceMesh,
    cpu_offload: bool = False,
    mesh: DeviceMesh | None = None,
) -> None:
    """Once sharded: send what was built for real under pp (``mesh``: the whole device mesh, whose ``pp`` stages
    decide who receives what), materialize what was on meta (from the twins, block by block), load the pretrained
    sources, and keep parameters left outside every FSDP unit in step over ``dp_mesh``."""
    weights.made["sent"] += materialize.send_kept(lm, weights.kept, device, mesh)
    weights.kept = {}
    if weights.on_meta:
        block_names = {name for name, _ in blocks}
        # Under CPU offload FSDP2 keeps the sharded parameters on the host: materialize them there.
        param_device = torch.device("cpu") if cpu_offload else None
        skip = weights.loaded | weights.restored
        if weights.local:
            weights.made["initialized"] = materialize.init_in_place(lm, weights.on_meta, skip, device, param_device)
        else:
            weights.made["initialized"] = materialize.materialize_streamed(
                lm, weights.twins, weights.on_meta, device, block_names, skip, param_device, mesh
            )
    for plan in weights.sources:
        load_pretrained(lm, plan)
    strays = _report_stray_parameters(lm)
    _strays_to_device(lm, strays, device)
    _average_stray_gradients(lm, strays, dp_mesh, device)
    accept_whole_state_dicts(lm)


def _report_stray_parameters(lm: nn.Module) -> list[str]:
    """Warn, by name and size, about each parameter left outside every ``fully_shard`` unit (one the
    LightningModule holds itself): it is not sharded and every rank keeps it whole. Returns the names."""
    stray = [(n, p) for n, p in lm.named_parameters() if not isinstance(p, DTensor)]
    if stray:
        listed = ", ".join(f"{n} ({p.numel():,} elements)" for n, p in stray[:10])
        warnings.warn(
            f"{len(stray)} parameter(s) outside every FSDP unit, replicated whole on every rank (their gradients "
            f"are averaged over the data-parallel ranks, as DDP does): {listed}. FSDP2 shards no 0-d parameter "
            "(make it a 1-element tensor, torch.ones(1), to shard it), and under Fabric a parameter the set-up "
            "module holds itself belongs to no unit (move it into a submodule, e.g. self.head = nn.Linear(...)).",
            stacklevel=2,
        )
    return [n for n, _ in stray]


def _strays_to_device(lm: nn.Module, names: Sequence[str], device: torch.device) -> None:
    """Stray parameters on the training device, where FSDP2 leaves them wherever they were built (it neither shards
    nor moves the 0-d ones it ignores) and CPU offload materialized them on the host: a host parameter would cost a
    device-to-host copy of its gradient at every backward, and its gradient cannot reach an NCCL group."""
    params = dict(lm.named_parameters())
    strays = {id(params[name]) for name in names}
    moved: dict[int, nn.Parameter] = {}  # old parameter -> its copy on the device (tied names stay tied)
    for module in lm.modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or id(param) not in strays or param.is_meta or param.device == device:
                continue
            if id(param) not in moved:
                moved[id(param)] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
            module._parameters[leaf] = moved[id(param)]


def _average_stray_gradients(lm: nn.Module, names: Sequence[str], dp_mesh: DeviceMesh, device: torch.device) -> None:
    """Keep replicated (stray) parameters in step: average each one's gradient over the data-parallel ranks as
    it is accumulated (FSDP2 reduces only the parameters it manages), on ``device`` (the mesh's: a gradient kept
    elsewhere is all-reduced through a copy there)."""
    if dp_mesh.size() == 1:
        return
    group, size = dp_mesh.get_group(), dp_mesh.size()

    def average(param: torch.Tensor) -> None:
        grad = compat.on_group_device(param.grad, device)
        torch.distributed.all_reduce(grad, group=group)
        if grad is not param.grad:
            param.grad.copy_(grad)
        param.grad.div_(size)

    params = dict(lm.named_parameters())
    for name in names:
        params[name].register_post_accumulate_grad_hook(average)
