"""Sharded checkpoints: a directory written with ``torch.distributed.checkpoint`` (DCP).

Model and optimizer state are stored by original parameter name (FQN), every rank writing its
own shards, so a checkpoint loads into another layout. Lightning's own state (loops, callbacks,
schedulers) sits beside them in ``meta.pt``. The directory is written under a temporary name and
renamed only when every rank has finished, so a crash never leaves a half checkpoint under the
real name.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

META_FILE = "meta.pt"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], lightning_state: dict[str, Any]
) -> None:
    """Write ``path`` atomically: into ``path.tmp-<name>``, then rename once all ranks are done."""
    tmp = path.with_name(f".{path.name}.tmp")
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    state: dict[str, Any] = {"model": get_model_state_dict(module, options=_OPTIONS)}
    for idx, opt in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(module, opt, options=_OPTIONS)
    dcp.save(state, checkpoint_id=tmp)
    if _rank() == 0:
        torch.save(lightning_state, tmp / META_FILE)
    _barrier()
    if _rank() == 0:
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    _barrier()


def load_sharded(path: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool = True) -> dict[str, Any]:
    """Load model (and optimizer) shards into the current layout; return Lightning's state."""
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a Cuboid sharded checkpoint (a directory with '.metadata' and '{META_FILE}')."
        )
    state: dict[str, Any] = {"model": get_model_state_dict(module, options=_OPTIONS)}
    for idx, opt in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(module, opt, options=_OPTIONS)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    for idx, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{idx}"], options=_OPTIONS)
    # meta.pt holds Lightning's loop/callback state written by this library: plain containers.
    return torch.load(path / META_FILE, map_location="cpu", weights_only=False)
