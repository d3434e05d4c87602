"""Giving parameters real values: the same initial weights on every layout, never the whole model on one rank.

Two cases:

* The model was built with real weights (the usual ``__init__``). Every rank seeded the same
  way, but to be safe against unseeded construction, rank 0's values are broadcast to all ranks
  (as DDP does), one tensor at a time; under pipeline parallelism, once the stages are split, to the ranks of the
  stages that keep each tensor. Parameters stay in host memory until ``fully_shard`` moves each
  block's to the accelerator as it shards it.
* The model was built on the meta device (``with torch.device("meta")`` in ``configure_model``),
  so a model too large for one accelerator never materializes there. Cuboid keeps a meta copy
  (a twin) of each top-level child, shards the original and gives its *meta* tensors empty storage. Then rank 0
  walks the twin piece by piece (a block, or one module's own tensors such as the embedding), gives that piece
  host storage, runs the model's own init (``init_weights()`` where a module defines it, else
  ``reset_parameters()``; then PEFT's for LoRA adapters), sends the piece tensor by tensor to the ranks that hold
  it (under pipeline parallelism, its stage's ranks only: ``cuboid.parallel.delivery``) and frees it; every rank
  keeps its slice. The
  init runs over the whole twin each time, but draws random numbers only for the piece's real tensors, so the
  values equal one full init of the model. This avoids DTensor random init, which on CPU writes the same numbers
  into every shard.

Only what was on the meta device is materialized: a torchmetrics metric or a submodule built for
real in ``__init__`` (beside a model built on meta in ``configure_model``) keeps its values, and
they are broadcast from rank 0 like a model built for real. What ``pretrained=`` fills is skipped, and so is what
a checkpoint about to be loaded fills (``ckpt_path``): then nothing is initialised, only given storage.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cuboid.adapters import init_adapters
from cuboid.compat import module_apply
from cuboid.parallel.delivery import Delivery


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` under every name it has (a tied tensor once per name)."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def meta_names(module: nn.Module) -> set[str]:
    """Names of the parameters and buffers (non-persistent ones included) that are on the meta device."""
    return {name for name, tensor in _named_tensors(module) if tensor.is_meta}


def to_device_except_parameters(module: nn.Module, device: torch.device) -> None:
    """Move the real tensors that are not parameters to ``device`` (buffers, and what modules keep through
    ``_apply``, such as torchmetrics states); meta tensors stay on meta. Parameters stay where they were built:
    ``fully_shard`` moves each block's to the accelerator as it shards it, so a model built for real is never
    whole there."""
    params = {id(p) for p in module.parameters()}
    module_apply(module, lambda t: t if t.is_meta or id(t) in params else t.to(device))


def materialize_meta(module: nn.Module, device: torch.device, param_device: torch.device | None = None) -> None:
    """``to_empty`` for the meta tensors only: give them uninitialized storage on ``device`` (parameters on
    ``param_device`` when given: the host, under CPU offload); every other tensor, a metric's state or a real
    submodule's weights, keeps its values.

    Goes through ``nn.Module._apply``, as ``to_empty`` does, so that FSDP2 (which re-registers its sharded
    parameters) and torchmetrics (which moves its states and defaults) see the change.
    """
    tied = [names for names in _alias_groups(module).values() if len(names) > 1]
    params = {id(p) for p in module.parameters()}
    where = {True: param_device or device, False: device}
    module_apply(module, lambda t: torch.empty_like(t, device=where[id(t) in params]) if t.is_meta else t)
    for names in tied:  # _apply gives each name of a shared meta parameter its own tensor: share it again
        first = module.get_parameter(names[0]) if _is_parameter(module, names[0]) else None
        for name in names[1:] if first is not None else []:
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner)
            if sub._parameters.get(leaf) is not first:
                sub._parameters[leaf] = first


def _is_parameter(module: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf in module.get_submodule(owner)._parameters


def broadcast_from_rank0(module: nn.Module, device: torch.device, skip: set[str] = frozenset()) -> int:  # type: ignore[assignment]
    """Overwrite every real parameter and buffer with rank 0's values (plain, unsharded tensors; meta ones and
    the names in ``skip`` left alone), one tensor at a time through ``device`` when it lives elsewhere. Returns
    how many tensors were sent."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    sent = 0
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_meta or name in skip:
                continue
            sent += 1
            if tensor.device == device:
                dist.broadcast(tensor.data, src=0)
            else:
                staged = tensor.data.to(device)
                dist.broadcast(staged, src=0)
                tensor.data.copy_(staged)
    return sent


def keep_for_stages(module: nn.Module, skip: set[str] = frozenset()) -> dict[str, tuple[torch.Tensor, list[str]]]:  # type: ignore[assignment]
    """Under pipeline parallelism, what was built for real is sent once the stages are split, to the ranks that
    keep it (:func:`send_kept`): each real tensor (less ``skip``) by its first name, with all its names. Rank 0
    keeps its values; the other ranks keep meta stand-ins (shape and dtype), so their copies are freed as sharding
    replaces them."""
    first_rank = not dist.is_initialized() or dist.get_rank() == 0
    tensors = dict(_named_tensors(module))
    kept = {}
    for first, names in _alias_groups(module).items():
        tensor = tensors[first]
        if tensor.is_meta or first in skip:
            continue
        kept[first] = (tensor.detach() if first_rank else torch.empty_like(tensor, device="meta"), names)
    return kept


@torch.no_grad()
def send_kept(
    root: nn.Module, kept: dict[str, tuple[torch.Tensor, list[str]]], device: torch.device, mesh: DeviceMesh | None
) -> int:
    """Send what :func:`keep_for_stages` kept to the ranks that hold it after the split (rank 0's values, each
    rank copying its slice). Returns how many tensors went out."""
    if not kept or not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    current = dict(_named_tensors(root))
    items = [(value, _unique([current[n] for n in names if n in current])) for value, names in kept.values()]
    delivery = Delivery(mesh, device)
    delivery.plan([bool(targets) for _, targets in items])
    first_rank = dist.get_rank() == 0
    for index, (value, targets) in enumerate(items):
        delivery.send(index, value if first_rank else None, value, targets)
    delivery.close()
    return len(items)


def init_module(module: nn.Module) -> None:
    """Run a module's own initialisation: ``init_weights()`` if it has one, else ``reset_parameters()``
    on it and its descendants (pre-order, the order construction ran them)."""
    if callable(getattr(module, "init_weights", None)):
        module.init_weights()
        return
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    for child in module.children():
        init_module(child)


def meta_twins(root: nn.Module) -> dict[str, nn.Module]:
    """Meta copies of the top-level children, taken before sharding (cheap: no storage)."""
    return {name: copy.deepcopy(child) for name, child in root.named_children() if _has_meta_tensors(child)}


def _alias_groups(module: nn.Module, prefix: str = "") -> dict[str, list[str]]:
    """Each tensor's first name -> all its names (a tied weight has several), parameters and buffers."""
    groups: dict[int, list[str]] = {}
    for name, tensor in _named_tensors(module):
        groups.setdefault(id(tensor), []).append(prefix + name)
    return {names[0]: names for names in groups.values()}


def _init_pieces(twin: nn.Module, blocks: set[str]) -> list[tuple[nn.Module, bool]]:
    """The pieces rank 0 initialises one at a time, in the order of the module's tensors: each block whole
    ``(block, True)``, and each other module's own tensors ``(module, False)`` (the embedding, a norm, the head)."""
    pieces: list[tuple[nn.Module, bool]] = []

    def walk(module: nn.Module, name: str) -> None:
        if name in blocks:
            pieces.append((module, True))
            return
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            pieces.append((module, False))
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name)

    walk(twin, "")
    return pieces


def _forget_init_flags(module: nn.Module) -> None:
    """Clear transformers' ``_is_hf_initialized`` marks, so that its ``init_weights`` runs again for the next piece."""
    for m in module.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    for t in [*module.parameters(), *module.buffers()]:
        t.__dict__.pop("_is_hf_initialized", None)


class InitError(RuntimeError):
    """A tensor on the meta device that the model's own init left without values."""


@torch.no_grad()
def materialize_streamed(
    root: nn.Module,
    twins: dict[str, nn.Module],
    on_meta: set[str],
    device: torch.device,
    blocks: set[str],
    skip: set[str] = frozenset(),  # type: ignore[assignment]
    param_device: torch.device | None = None,
    mesh: DeviceMesh | None = None,
) -> int:
    """Give the sharded ``root``'s meta tensors storage on ``device`` (parameters on ``param_device`` when given),
    then fill those named in ``on_meta`` (less ``skip``: what pretrained weights or a checkpoint about to be loaded
    fill) from rank 0's host-side init, one piece at a time. Returns how many pieces this rank initialised.

    Rank 0 gives one piece of the meta twin host storage (a block, or one module's own tensors), runs the model's
    own init over the whole twin (on the meta rest it draws no random numbers, so each piece gets exactly the
    values a full init gives it when the init draws in tensor order, as ``init_weights``/``reset_parameters`` and
    transformers' ``_init_weights`` do), sends the piece tensor by tensor to the ranks that hold it (under pipeline
    parallelism, only its stage's: :class:`~cuboid.parallel.delivery.Delivery` over ``mesh``), and frees it. Every
    rank copies out its own slice. Host memory on rank 0: one piece (the largest block, or the embedding).
    """
    materialize_meta(root, device, param_device)
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    current = dict(_named_tensors(root))
    pieces = []  # (twin, prefix, piece, recurse, [(first name, meta tensor, this rank's targets)])
    for twin_name, twin in twins.items():
        prefix = f"{twin_name}."
        groups = _alias_groups(twin, prefix)
        local_blocks = {b[len(prefix) :] for b in blocks if b.startswith(prefix)}
        done: set[str] = set()
        for piece, recurse in _init_pieces(twin, local_blocks):
            names = [
                (first, like, _unique([current[n] for n in groups[first] if n in current]))
                for first, like in _piece_tensors(twin, piece, recurse, groups, prefix)
                if first in on_meta and first not in skip and first not in done
            ]
            done.update(first for first, _, _ in names)  # a tied tensor: filled once, at its first name's piece
            if names:
                pieces.append((twin, prefix, piece, recurse, names))
    if not pieces:  # everything comes from pretrained weights or a checkpoint (the same on every rank)
        return 0
    order = [first for *_, names in pieces for first, _, _ in names]
    delivery = Delivery(mesh, device)
    delivery.plan([bool(targets) for *_, names in pieces for _, _, targets in names])
    bad, index = -1, 0
    with torch.random.fork_rng(devices=[]):
        for twin, prefix, piece, recurse, names in pieces:
            values = _init_piece(twin, piece, recurse, prefix, [n for n, _, _ in names]) if is_rank0 else None
            for first, like, targets in names:
                value = values[first] if values is not None else None
                if bad < 0 and value is not None and value.is_floating_point() and bool(value.isnan().any()):
                    bad = index
                delivery.send(index, value, like, targets)
                index += 1
            if is_rank0:
                module_apply(twin, lambda t: t if t.is_meta else torch.empty_like(t, device="meta"))
    delivery.close()
    _agree_on_init(bad, order, device)
    return len(pieces) if is_rank0 else 0


@torch.no_grad()
def init_in_place(
    root: nn.Module,
    on_meta: set[str],
    skip: set[str],
    device: torch.device,
    param_device: torch.device | None = None,
) -> int:
    """Each rank's own shards made where they live: the sharded ``root``'s meta tensors get storage on ``device``,
    then the model's own init runs on the sharded model itself (each top-level child holding one of ``on_meta``
    less ``skip``; then PEFT's for LoRA adapters). Nothing is sent. Returns how many top-level children it
    initialised (0 when pretrained weights or a checkpoint fill everything).

    On a GPU, DTensor's random ops give each shard its own part of one draw (its random-number tracker, made at
    set-up): the same distribution as one process's init, not the same values. On CPU, DTensor has no tracker and
    every shard draws the same numbers (a test of the path, not a distribution). What was built for real keeps its
    values (set aside before, put back after); a tensor the init leaves unset stops every rank with its name.
    """
    materialize_meta(root, device, param_device)
    tensors = dict(_named_tensors(root))
    todo = {name for name in on_meta - skip if name in tensors}  # under pp: this rank's stages only
    if not todo:
        return 0
    kept = {name: t.detach().clone() for name, t in tensors.items() if name not in on_meta}
    names = sorted(todo)
    for name in names:
        if tensors[name].is_floating_point():
            _local(tensors[name]).fill_(float("nan"))
    children = [child for name, child in root.named_children() if any(n.startswith(f"{name}.") for n in todo)]
    with warnings.catch_warnings():  # on a CPU mesh torch warns at every random op on a DTensor (see above)
        warnings.filterwarnings("ignore", message=".*random operators may not have complete support.*")
        for child in children:
            _forget_init_flags(child)
            init_module(child)
            init_adapters(child)
    for name, value in kept.items():
        tensors[name].copy_(value)
    unset = [n for n, nan in zip(names, torch.stack([_local(tensors[n]).isnan().any() for n in names]).tolist(),
                                 strict=True) if nan]  # fmt: skip
    flag = torch.tensor([len(unset)], device=device)
    if dist.is_initialized():  # (each stage has its own names: one count, then the names only when one is unset)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(everyone, unset)
            unset = sorted({n for found in everyone for n in found})
    _agree_on_init(0 if unset else -1, unset, device, agreed=True)
    return len(children)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


def _piece_tensors(
    twin: nn.Module, piece: nn.Module, recurse: bool, groups: dict[str, list[str]], prefix: str
) -> list[tuple[str, torch.Tensor]]:
    """The (first name, meta tensor) pairs a piece owns: tensors whose first name lies in it."""
    by_id: dict[int, str] = {}
    for n, t in _named_tensors(twin):
        by_id.setdefault(id(t), n)
    tensors = [*piece.parameters(recurse=recurse), *piece.buffers(recurse=recurse)]
    out, seen = [], set()
    for t in tensors:
        first = prefix + by_id[id(t)] if id(t) in by_id else None
        if first is None or first not in groups or id(t) in seen:
            continue
        seen.add(id(t))
        out.append((first, t))
    return out


def _blank(t: torch.Tensor) -> torch.Tensor:
    """Host storage for a meta tensor: NaN where it can hold one, so that values the init never wrote are found."""
    if not t.is_meta:
        return t
    fill = float("nan") if t.is_floating_point() or t.is_complex() else 0
    return torch.full_like(t, fill, device="cpu")


def _init_piece(
    twin: nn.Module, piece: nn.Module, recurse: bool, prefix: str, names: list[str]
) -> dict[str, torch.Tensor]:
    """Rank 0: host storage for one piece, the model's init over the whole twin, the piece's values by name."""
    module_apply(piece, _blank, recurse)
    _forget_init_flags(twin)
    init_module(twin)
    init_adapters(twin)  # PEFT's LoRA layers: their own init after the base model's (B zero)
    state = {prefix + n: t for n, t in _named_tensors(twin)}
    return {n: state[n] for n in names}


def _agree_on_init(bad: int, names: list[str], device: torch.device, agreed: bool = False) -> None:
    """Every rank stops together when the init left a tensor without values (still NaN): ``bad`` is its index in
    ``names`` on rank 0 (-1: none), sent to every rank once, after every piece (``agreed``: every rank has it)."""
    index = bad
    if not agreed:
        flag = torch.tensor([bad], device=device)
        if dist.is_initialized():
            dist.broadcast(flag, src=0)
        index = int(flag.item())
    if index >= 0:
        name = names[index]
        raise InitError(
            f"{name} was built on the meta device and the model's init (init_weights() or reset_parameters()) "
            "gave it no value (a non-persistent buffer computed in __init__, or a parameter no init covers). "
            "Set it in the module's init_weights()/reset_parameters(), or build that module for real (outside "
            "the meta device); a pretrained= source fills only what its weights file holds."
        )
