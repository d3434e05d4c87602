"""Sharded checkpoints: a directory written with ``torch.distributed.checkpoint`` (DCP).

Model and optimizer state are stored by original parameter name (FQN), every rank writing its
own shards, so a checkpoint loads into another layout. Lightning's own state (loops, callbacks,
schedulers) sits beside them in ``meta.pt``. The directory is written under a temporary name and
renamed only when every rank has finished, so a crash never leaves a half checkpoint under the
real name.
"""

from __future__ import annotations

import pickle
import shutil
import threading
from collections.abc import Callable, Sequence
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
RNG_DIR = "rng"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; nothing was changed."""


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def check_loadable(path: Path, allow_file: bool = False) -> None:
    """Refuse, with a clear message, anything that is not a complete Cuboid checkpoint.

    ``allow_file``: a file passes (a ``checkpoint_format="full"`` checkpoint, checked when read).
    """
    if path.name.startswith(".") and ".tmp" in path.name:
        raise CheckpointError(
            f"{path} is the temporary copy of a save that never finished; load the previous complete "
            f"checkpoint instead (its name has no leading dot)."
        )
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    if path.is_file() and allow_file:
        return
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file, not a Cuboid sharded checkpoint (a directory written by CuboidStrategy with "
            f"'.metadata' and '{META_FILE}')."
        )
    missing = [name for name in (".metadata", META_FILE) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{path} is not a complete Cuboid checkpoint: {', '.join(missing)} missing. A save that was "
            f"interrupted leaves only a hidden '.<name>.tmp' directory; load the previous checkpoint."
        )


def _check_keys(path: Path, stored: set[str], expected: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model entries (``model.<fqn>``) are not this model's parameters."""
    wanted = {f"model.{k}" for k in expected}
    if dist.is_initialized():  # pipeline stages each hold part of the model: compare the union
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, wanted)
        wanted = set().union(*everyone)
    have = {k for k in stored if k.startswith("model.")}
    missing, unexpected = sorted(wanted - have), sorted(have - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} holds another model: {len(missing)} parameters missing (e.g. {[m[6:] for m in missing[:3]]}) "
            f"and {len(unexpected)} unexpected (e.g. {[u[6:] for u in unexpected[:3]]}). Nothing was loaded."
        )


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(
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
    _barrier()
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
        _barrier()
        publish(tmp, path)
        _barrier()
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
        publish(tmp, path)
        dist.barrier(group=async_group)

    thread = threading.Thread(target=finish, name=f"cuboid-save-{path.name}", daemon=True)
    thread.error = None  # type: ignore[attr-defined]
    thread.start()
    return thread


def save_failed(path: Path, tmp: Path, err: BaseException) -> CheckpointError:
    """The error a failed save raises: what failed, that nothing was replaced, and where the partial write is."""
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
    if failures:
        what = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(failures.items()))
    else:
        what = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return CheckpointError(
        f"saving {path.name} failed ({what}). Nothing was replaced: the previous "
        f"checkpoints in {path.parent} are intact and resumable; the partial write {tmp.name} may be deleted. "
        "Free disk space or fix the directory's permissions, then resume (ckpt_path='auto' picks the newest "
        "complete checkpoint)."
    )


def publish(tmp: Path, path: Path) -> None:
    """Rank 0 moves the finished temporary directory (or file) to its real name, replacing an older one."""
    if rank() != 0:
        return
    old = path.with_name(f".{path.name}.old")
    if path.exists() or path.is_symlink():
        remove_path(old)
        path.rename(old)
    tmp.rename(path)
    remove_path(old)


def state_dicts(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """What both formats store: ``{"model": ..., "optimizer_<i>": ...}``, by parameter name (flattened optimizer
    state), values as this rank holds them (DTensor shards)."""
    state: dict[str, Any] = {"model": get_model_state_dict(module, options=_OPTIONS)}
    for idx, opt in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(module, opt, options=_OPTIONS)
    return state


def load_state(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, stored: set[str], **dcp_load: Any
) -> None:
    """Read a checkpoint's entries (``stored``: its flattened keys) into this layout with DCP and set them.

    A checkpoint without optimizer entries (``ModelCheckpoint(save_weights_only=True)``) sets the model
    only; Lightning itself refuses to resume training from it, with its own message.
    """
    if not any(k.startswith("optimizer_") for k in stored):
        optimizers = []
    state = state_dicts(module, optimizers)
    if strict:
        _check_keys(path, stored, state["model"])
    try:
        dcp.load(state, **dcp_load)
    except Exception as err:  # DCP wraps per-rank read failures
        raise CheckpointError(f"could not read {path} (corrupted or incomplete?): {err}") from err
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    for idx, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{idx}"], options=_OPTIONS)


def remove_path(path: Path) -> None:
    """Delete a checkpoint directory, file or link (a link only, never what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load model (and optimizer) shards into the current layout; return Lightning's state.

    Also reads the sharded directories of Lightning's ModelParallelStrategy and FSDPStrategy. DCP reads
    each parameter by its original name and reshards it to this layout, so a checkpoint from any pp x dp x tp layout (or one process) loads here. Each rank's RNG state is restored
    when the world size is the same as at save time. A checkpoint saved without optimizer state
    (``save_weights_only``) loads the model only. ``weights_only`` is Lightning's and torch's
    flag for the pickled Lightning state in ``meta.pt``: ``None`` means ``True``.
    """
    check_loadable(path)
    stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    meta = load_pickled(path / META_FILE, weights_only)
    if "cuboid" not in meta:  # written by Lightning's ModelParallelStrategy or FSDPStrategy
        from cuboid.checkpoint_lightning import foreign_model_key, load_foreign_sharded

        key = foreign_model_key(stored)
        if key is None:
            raise CheckpointError(
                f"{path} is a DCP directory with neither 'state_dict.*' (ModelParallelStrategy) nor 'model.*' "
                "(FSDPStrategy, Cuboid) entries: not a Lightning checkpoint."
            )
        try:
            load_foreign_sharded(path, module, optimizers, key, strict)
        except Exception as err:  # DCP wraps per-rank failures: say which checkpoint, nothing else
            raise CheckpointError(f"could not load {path} (a Lightning {key!r} checkpoint): {err}") from err
        return meta
    load_state(path, module, optimizers, strict, stored, checkpoint_id=path)
    rng_file = path / RNG_DIR / f"rank{rank()}.pt"
    if rng_file.is_file() and same_world(meta):
        restore_rng(torch.load(rng_file, map_location="cpu", weights_only=True))
    return meta


def load_pickled(path: Path, weights_only: bool | None, mmap: bool = False) -> dict[str, Any]:
    """``torch.load`` of Lightning's state (loops, callbacks, hyper-parameters), ``weights_only`` by default.

    Lightning's state is pickled: only objects torch deems safe load unless ``weights_only=False``
    is passed (as ``trainer.fit(..., weights_only=False)``), which can run code from the file.
    """
    safe = True if weights_only is None else weights_only
    try:
        return torch.load(path, map_location="cpu", weights_only=safe, mmap=mmap)
    except pickle.UnpicklingError as err:
        if not safe:
            raise CheckpointError(f"could not unpickle {path} (corrupted?): {err}") from err
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        raise CheckpointError(
            f"{path} holds pickled objects that a weights-only load refuses ({', '.join(unsafe[:4]) or 'see torch'}), "
            "e.g. in the LightningModule's hyper-parameters. If the checkpoint comes from a place you trust, load it "
            "with trainer.fit(..., weights_only=False) (trainer.validate/test/predict take it too)."
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"could not read {path} (corrupted or incomplete?): {err}") from err


def same_world(meta: dict[str, Any]) -> bool:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return meta.get("cuboid", {}).get("world_size") == world


def collect_rng() -> dict[str, Any]:
    """This rank's RNG states (torch, CUDA, numpy, random) as tensors and plain values (weights-only loadable)."""
    from cuboid.compat import collect_rng_states

    states = collect_rng_states(include_cuda=torch.cuda.is_available())
    name, keys, pos, has_gauss, cached = states["numpy"]
    states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return states


def restore_rng(states: dict[str, Any]) -> None:
    from cuboid.compat import set_rng_states

    name, keys, pos, has_gauss, cached = states["numpy"]
    states["numpy"] = (name, keys.numpy().astype("uint32"), pos, has_gauss, cached)
    set_rng_states(states)


class SkipFirstBatches:
    """Wraps a train DataLoader so its next epoch starts ``skip`` batches in (mid-epoch resume).

    The skipped batches are drawn and dropped, so the sampler (seeded per epoch) hands every rank the
    same samples after resume as in the uninterrupted run. Later epochs are not affected. Has
    ``state_dict``/``load_state_dict`` so Lightning treats it as resumable.
    """

    def __init__(self, loader: Any, skip: int, epoch: int) -> None:
        self._loader, self._skip, self._epoch = loader, skip, epoch

    def __iter__(self) -> Any:
        skip, self._skip = self._skip, 0
        if skip:
            # Lightning creates the iterator before it sets the sampler's epoch: set it, or a resumed
            # epoch > 0 would be shuffled like epoch 0.
            from cuboid.compat import set_sampler_epoch

            set_sampler_epoch(self._loader, self._epoch)
        iterator = iter(self._loader)
        for _ in range(skip):
            next(iterator, None)
        return iterator

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ShardedFormat:
    """A DCP directory, every rank writing its own shards (scales to any model size)."""

    needs_gloo_group = False  # only an async save needs its own group

    def save(
        self,
        path: Path,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        lightning_state: dict[str, Any],
        *,
        mesh: Any,
        group: dist.ProcessGroup | None,
        background: bool,
        model_order: Sequence[str] | None,
        storage_writer: Callable[[Path], Any] | None,
        stager: Any = None,
    ) -> threading.Thread | None:
        return save_sharded(
            path, module, optimizers, lightning_state, storage_writer, group if background else None, stager
        )

    def load(
        self,
        path: Path,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        *,
        strict: bool,
        weights_only: bool | None,
        model_order: Sequence[str] | None,
    ) -> dict[str, Any]:
        return load_sharded(path, module, optimizers, strict=strict, weights_only=weights_only)


def read_model_weights(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full model weights of a checkpoint (sharded or full), by original name, in one process.

    Needs no process group and no knowledge of the training layout; reads the model entries only
    (never the optimizer state).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    check_loadable(path, allow_file=True)
    if path.is_file():  # checkpoint_format="full": memory-mapped, so only the weights' pages are read
        weights = load_pickled(path, weights_only=None, mmap=True).get("state_dict")
        if weights is None:
            raise CheckpointError(f"{path} is a file without a 'state_dict': not a Cuboid or Lightning checkpoint.")
        return {key: (t.to(dtype) if dtype else t) for key, t in weights.items()}
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return {key[len("model.") :]: (t.to(dtype) if dtype else t) for key, t in state.items()}


if __name__ == "__main__":  # `python -m cuboid.checkpoint export ...` (the CLI lives in cuboid.export)
    from cuboid.export import main

    main()
