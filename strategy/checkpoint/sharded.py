"""Sharded checkpoints: a directory written with ``torch.distributed.checkpoint`` (DCP).

Model and optimizer state are stored by original parameter name (FQN), every rank writing its
own shards, so a checkpoint loads into another layout (:class:`ShardedFormat`). Lightning's own state (loops, callbacks,
schedulers) sits beside them in ``meta.pt``. The directory is written under a temporary name and
renamed only when every rank has finished, so a crash never leaves a half checkpoint under the
real name; just before, the ranks write the checksums of every file, which a load verifies first
(:mod:`cuboid.checkpoint.integrity`).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from cuboid.checkpoint.format import (
    META_FILE,
    RNG_DIR,
    LoadRequest,
    SaveRequest,
    barrier,
    check_loadable,
    collect_rng,
    load_pickled,
    load_state,
    publish,
    rank,
    restore_rng,
    same_world,
    save_failed,
    state_dicts,
)
from cuboid.checkpoint.integrity import verify_checkpoint, write_checksums


def is_sharded_checkpoint(path: Path) -> bool:
    """A complete DCP directory with Lightning's ``meta.pt`` (Cuboid's, or a Lightning strategy's)."""
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def _save_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    lightning_state: dict[str, Any],
    storage_writer: Callable[[Path], Any] | None = None,
    async_group: dist.ProcessGroup | None = None,
    stager: Any = None,
) -> threading.Thread | None:
    """Write ``path`` atomically: into ``.<name>.tmp``, renamed once every rank is done.

    With ``async_group`` (a process group used only for checkpoints), the shards are copied to host
    memory (through ``stager``, a DCP ``AsyncStager`` kept across saves so its host buffers are reused),
    written in the background, and the rename happens in a background thread after a
    barrier on that group; the returned thread must be joined before the next save (training
    collectives on the default group and checkpoint collectives never share a group: on gloo they
    deadlocked when they did).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    if rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    state = state_dicts(module, optimizers)
    (tmp / RNG_DIR).mkdir(exist_ok=True)
    torch.save(collect_rng(), tmp / RNG_DIR / f"rank{rank()}.pt")
    if rank() == 0:
        torch.save(lightning_state, tmp / META_FILE)
    writer = storage_writer(tmp) if storage_writer else None
    if async_group is None:
        try:
            dcp.save(state, checkpoint_id=tmp, storage_writer=writer)
        except (Exception, dcp.CheckpointException) as err:  # (a BaseException) raised on every rank by DCP
            raise save_failed(path, tmp, err) from err
        barrier()
        write_checksums(tmp)
        publish(tmp, path)
        barrier()
        return None
    future = dcp.async_save(
        state, checkpoint_id=tmp, storage_writer=writer, process_group=async_group, async_stager=stager
    )

    def finish() -> None:
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as err:  # kept for the training thread: Checkpointer.failure
            thread.error = save_failed(path, tmp, err)  # type: ignore[attr-defined]
            return
        dist.barrier(group=async_group)
        try:
            write_checksums(tmp, async_group)
        except OSError as err:
            thread.error = save_failed(path, tmp, err)  # type: ignore[attr-defined]
            return
        publish(tmp, path)
        dist.barrier(group=async_group)

    thread = threading.Thread(target=finish, name=f"cuboid-save-{path.name}", daemon=True)
    thread.error = None  # type: ignore[attr-defined]
    thread.start()
    return thread


def _load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load model (and optimizer) shards of a Cuboid directory into the current layout; return Lightning's state.

    DCP reads each parameter by its original name and reshards it to this layout, so a checkpoint from any
    pp x dp x tp layout (or one process) loads here. Each rank's RNG state is restored when the world size is the
    same as at save time. A checkpoint saved without optimizer state (``save_weights_only``) loads the model only.
    ``weights_only`` is Lightning's and torch's flag for the pickled Lightning state in ``meta.pt``: ``None`` means
    ``True``.
    """
    check_loadable(path)
    verify_checkpoint(path)
    stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    meta = load_pickled(path / META_FILE, weights_only)
    load_state(path, module, optimizers, strict, stored, checkpoint_id=path)
    rng_file = path / RNG_DIR / f"rank{rank()}.pt"
    if rng_file.is_file() and same_world(meta):
        restore_rng(torch.load(rng_file, map_location="cpu", weights_only=True))
    return meta


class ShardedFormat:
    """``checkpoint_format="sharded"``: a DCP directory, every rank writing its own shards (scales to any model
    size), Lightning's state in ``meta.pt`` and each rank's RNG under ``rng/``."""

    name = "sharded"
    needs_gloo_group = False  # only an async save needs its own group

    def recognizes(self, path: Path) -> bool:
        return is_sharded_checkpoint(path) and (path / RNG_DIR).is_dir()  # Cuboid always writes rng/

    def save(self, request: SaveRequest) -> threading.Thread | None:
        r = request
        group = r.group if r.background else None
        return _save_sharded(r.path, r.module, r.optimizers, r.lightning_state, r.storage_writer, group, r.stager)

    def load(self, request: LoadRequest) -> dict[str, Any]:
        r = request
        return _load_sharded(r.path, r.module, r.optimizers, strict=r.strict, weights_only=r.weights_only)
