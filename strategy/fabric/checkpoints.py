"""Fabric's ``save`` / ``load`` on Cuboid's formats: a Fabric loop's state dict as a Cuboid checkpoint.

``fabric.save(path, {"model": model, "optimizer": optimizer, "iter_num": 3})`` writes the same directory (or, with
``checkpoint_format="full"``, the same file) a Trainer writes: the model's and the optimizers' state by parameter
name, every rank its shards, so it loads on any layout; everything else in the dict (counters, a scheduler's or a
data loader's ``state_dict()``) goes beside them in ``meta.pt``. The Trainer resumes from it (weights, optimizer
state; Lightning's loops, which a Fabric loop has none of, restart), and a Fabric loop loads a Trainer's checkpoint.
The model's names may differ by one leading prefix (``layers.0`` in the loop, ``model.layers.0`` as a
LightningModule's child): :func:`cuboid.checkpoint.format.load_state` matches them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric import __version__ as lightning_version
from torch import nn
from torch.optim import Optimizer

from cuboid.checkpoint import Checkpointer, CheckpointError

FABRIC_KEY = "fabric"  # under meta["cuboid"]: which entries of the state dict were the model and the optimizers


def split_state(state: Mapping[str, Any], module: nn.Module) -> tuple[str, list[tuple[str, Optimizer]], dict]:
    """``(model key, [(key, optimizer)], the rest)`` of a Fabric state dict whose model is ``module`` (the one the
    strategy set up). The rest: stateful objects as their ``state_dict()``, other values as they are."""
    models = [key for key, value in state.items() if isinstance(value, nn.Module)]
    if len(models) != 1 or state[models[0]] is not module:
        found = ", ".join(f"{k!r}" for k in models) or "none"
        raise CheckpointError(
            f"fabric.save/load with CuboidStrategy takes the one model set up with fabric.setup in its state dict "
            f"(e.g. {{'model': model, 'optimizer': optimizer}}); this state holds modules: {found}. Save other "
            "modules' state_dict() instead, or set each model up in its own Fabric."
        )
    optimizers = [(key, value) for key, value in state.items() if isinstance(value, Optimizer)]
    rest = {}
    for key, value in state.items():
        if key == models[0] or isinstance(value, Optimizer):
            continue
        state_dict = getattr(value, "state_dict", None)
        rest[key] = state_dict() if callable(state_dict) and not isinstance(value, type) else value
    return models[0], optimizers, rest


def save(
    checkpointer: Checkpointer,
    path: Path,
    state: Mapping[str, Any],
    module: nn.Module,
    layout: Mapping[str, int],
    mesh: Any,
) -> None:
    """Write a Fabric state dict as a Cuboid checkpoint (the checkpointer's format), atomically."""
    model_key, optimizers, rest = split_state(state, module)
    meta: dict[str, Any] = {
        **rest,
        "pytorch-lightning_version": lightning_version,  # what a Trainer's resume reads first
        "lr_schedulers": rest.get("lr_schedulers", []),
        "cuboid": {
            "layout": dict(layout),
            "world_size": dist.get_world_size(),
            "batches_done_in_epoch": 0,
            FABRIC_KEY: {"model": model_key, "optimizers": [key for key, _ in optimizers]},
        },
    }
    checkpointer.write(path, module, [opt for _, opt in optimizers], meta, mesh)
    checkpointer.wait()  # a Fabric loop reads its checkpoint back right away: no save outlives fabric.save


def load(
    checkpointer: Checkpointer,
    path: Path,
    state: Mapping[str, Any] | nn.Module,
    module: nn.Module,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Load a Cuboid or Trainer checkpoint into a Fabric state dict in place (the model and optimizers shard by
    shard, other entries from ``meta.pt``); return what the checkpoint holds that ``state`` did not ask for."""
    if isinstance(state, nn.Module):
        if state is not module:
            raise CheckpointError("fabric.load(path, model): pass the model that was set up with fabric.setup.")
        checkpointer.load(path, module, [], strict, weights_only)
        return {}
    if not isinstance(state, dict) or not state:
        raise CheckpointError(
            "fabric.load with CuboidStrategy restores into a state dict ({'model': model, 'optimizer': optimizer, "
            "...}): a sharded checkpoint has no whole tensors to return. Pass the objects to restore."
        )
    model_key, optimizers, _ = split_state(state, module)
    meta = checkpointer.load(path, module, [opt for _, opt in optimizers], strict, weights_only)
    restored = {model_key, *(key for key, _ in optimizers)}
    wanted = [key for key in state if key not in restored]
    missing = [key for key in wanted if key not in meta]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint "
            f"{path}. To disable strict loading, set `strict=False`."
        )
    for key in wanted:
        if key not in meta:
            continue
        loader = getattr(state[key], "load_state_dict", None)
        if callable(loader) and not isinstance(state[key], type):
            loader(meta.pop(key))
        else:
            state[key] = meta.pop(key)
    for key in ("cuboid", "pytorch-lightning_version"):
        meta.pop(key, None)
    return meta
