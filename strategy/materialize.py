"""Giving parameters real values: the same initial weights on every layout.

Two cases:

* The model was built with real weights (the usual ``__init__``). Every rank seeded the same
  way, but to be safe against unseeded construction, rank 0's values are broadcast to all ranks
  before anything is sharded (as DDP does).
* The model was built on the meta device (``with torch.device("meta")`` in ``configure_model``),
  so a model too large for one accelerator never materializes there. Cuboid keeps a meta copy
  of each top-level child, shards the original, gives its *meta* tensors empty storage on the
  device, and rank 0 initialises the copy on *host* memory with the model's own recipe
  (``init_weights()`` where a module defines it, else ``reset_parameters()``); then the values of
  the tensors that were on meta are scattered shard by shard with
  ``set_model_state_dict(..., broadcast_from_rank0=True)``. This avoids DTensor random init, which
  on CPU writes the same numbers into every shard.

Only what was on the meta device is materialized: a torchmetrics metric or a submodule built for
real in ``__init__`` (beside a model built on meta in ``configure_model``) keeps its values, and
they are broadcast from rank 0 like a model built for real.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from cuboid.compat import module_apply


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def meta_names(module: nn.Module) -> set[str]:
    """Names of the parameters and buffers (non-persistent ones included) that are on the meta device."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {name for name, tensor in tensors if tensor.is_meta}


def to_device_except_meta(module: nn.Module, device: torch.device) -> None:
    """Move every real tensor to ``device`` (parameters, buffers, and what modules keep through ``_apply``, such
    as torchmetrics states); meta tensors stay on meta. ``nn.Module.to`` would fail on the meta ones."""
    module_apply(module, lambda t: t if t.is_meta else t.to(device))


def materialize_meta(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` for the meta tensors only: give them uninitialized storage on ``device``; every other tensor,
    a metric's state or a real submodule's weights, keeps its values.

    Goes through ``nn.Module._apply``, as ``to_empty`` does, so that FSDP2 (which re-registers its sharded
    parameters) and torchmetrics (which moves its states and defaults) see the change.
    """
    module_apply(module, lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


def broadcast_from_rank0(module: nn.Module) -> None:
    """Overwrite every real parameter and buffer with rank 0's values (plain, unsharded tensors; meta ones skipped)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if not tensor.is_meta:
                dist.broadcast(tensor.data, src=0)


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
    return {name: copy.deepcopy(child) for name, child in root.named_children() if has_meta_tensors(child)}


def materialize_from_twins(
    root: nn.Module, twins: dict[str, nn.Module], on_meta: set[str], device: torch.device
) -> None:
    """Give the sharded ``root``'s meta tensors (``on_meta``: their names, taken before sharding) storage on
    ``device`` and fill them from rank 0's host-side init; nothing else is touched."""
    materialize_meta(root, device)
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    full_state: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if is_rank0:
        with torch.random.fork_rng(devices=[]):
            for name, twin in twins.items():
                twin.to_empty(device="cpu")
                init_module(twin)
                full_state.update({f"{name}.{k}": v for k, v in twin.state_dict().items() if f"{name}.{k}" in on_meta})
                buffers.update({f"{name}.{k}": v for k, v in twin.named_buffers() if f"{name}.{k}" in on_meta})
    set_model_state_dict(
        root, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )
    # Non-persistent buffers are not in the state dict: send them separately.
    with torch.no_grad():
        for name, buf in root.named_buffers():
            if name not in on_meta:
                continue
            if is_rank0:
                buf.copy_(buffers[name])
            if dist.is_initialized():
                dist.broadcast(buf, src=0)
