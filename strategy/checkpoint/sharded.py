"""Sharded checkpoints: a directory written with ``torch.distributed.checkpoint`` (DCP).

Model and optimizer state are stored by original parameter name (FQN), every rank writing its
own shards, so a checkpoint loads into another layout (:class:`ShardedFormat`). Lightning's own state (loops, callbacks,
schedulers) sits beside them in ``meta.pt``. The directory is written under a temporary name and
renamed only when every rank has finished, so a crash never leaves a half checkpoint under the
real name.

Checksums: torch's DCP keeps none, so a shard damaged on disk (bit rot, a torn copy between file systems) would
load without a word and be trained on. The save ends, before the rename, with every rank hashing the files it
wrote (its DCP shards and RNG state; rank 0 also ``.metadata`` and ``meta.pt``), still in its host's page cache, and
rank 0 writing their sizes and xxHash3 (64-bit) digests to ``checksums.json``. A load first checks them, each rank
the files of the rank it takes the place of, and stops before any weight is read with :class:`CheckpointDamaged`,
which names every damaged or missing file and the checkpoint. A checkpoint without ``checksums.json`` (written
before Cuboid kept them, or by another tool) loads with a warning that it cannot be verified; one with CRC-32s
(Cuboid's first checksums) is verified with CRC-32. xxHash3 (about 25 GB/s a core, 4x zlib's CRC-32) finds bit rot
and torn or truncated copies; it is not a defence against someone who changes a file on purpose.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import threading
import warnings
import zlib
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.optim import Optimizer

from cuboid.checkpoint.format import (
    META_FILE,
    RNG_DIR,
    CheckpointError,
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
from cuboid.storage import (
    COMMIT,
    RemotePath,
    committed_at,
    dcp_reader,
    dcp_writer,
    readable,
    save_object,
    to_path,
)

# --- checksums -----------------------------------------------------------------------------------------------
CHECKSUMS = "checksums.json"
ALGORITHM = "xxh3_64"  # what saves write; "crc32" (zlib) is what checkpoints of 2026-12-03 hold, still verified
_DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")  # DCP's file of the i-th rank of its group
_RNG_FILE = re.compile(rf"{RNG_DIR}/rank(\d+)\.pt")
_SHOWN = {"xxh3_64": "xxHash3", "crc32": "CRC-32"}


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files do not match the checksums its save wrote; the message names them."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        super().__init__(
            f"checkpoint {path} is damaged: {'; '.join(problems)}. Its files changed after the save wrote them (a "
            "disk or copy error); nothing was loaded. Resume from an earlier checkpoint (ckpt_path='auto' in the "
            "main job does so by itself), or copy this one again from where it was written. The damaged checkpoint "
            "is left as it is."
        )


def file_digest(path: Path | RemotePath, algorithm: str = ALGORITHM) -> str:
    """The digest of a file's bytes, in hex: ``xxh3_64`` (16 digits) or ``crc32`` (8). A local file is mapped, not
    copied: a file the save has just written is hashed from the page cache at memory speed. A remote object is read
    back from the store in 8 MiB pieces: what is hashed is what landed there."""
    if isinstance(path, RemotePath):
        return _stream_digest(path, algorithm)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else nullcontext(b"") as data:
            if algorithm == "xxh3_64":
                return xxhash.xxh3_64_hexdigest(data)
            if algorithm == "crc32":
                return f"{zlib.crc32(data):08x}"
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r}: this Cuboid knows xxh3_64 and crc32")


def _stream_digest(path: RemotePath, algorithm: str) -> str:
    if algorithm not in ("xxh3_64", "crc32"):
        raise CheckpointError(f"unknown checksum algorithm {algorithm!r}: this Cuboid knows xxh3_64 and crc32")
    digest, crc = xxhash.xxh3_64(), 0
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            crc = zlib.crc32(chunk, crc)
    return digest.hexdigest() if algorithm == "xxh3_64" else f"{crc:08x}"


def _files(root: Path | RemotePath) -> list[str]:
    if isinstance(root, RemotePath):  # the marker comes after the checksums
        return [name for name in root.files() if name not in (CHECKSUMS, COMMIT)]
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def _world(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _share(names: list[str], me: int, world: int) -> list[str]:
    """The files rank ``me`` of ``world`` hashes: each its own (DCP's shards of the i-th rank, that rank's RNG
    state), whose bytes the save left in its host's page cache, and which a load at the same layout reads there too;
    the rest (``.metadata``, ``meta.pt``) on rank 0. When the checkpoint has fewer owners than ranks (a resume on
    more ranks), every world-th file instead, so that the work is spread."""
    owners = {}
    for name in names:
        found = _DCP_SHARD.fullmatch(name) or _RNG_FILE.fullmatch(name)
        owners[name] = int(found.group(1)) if found else 0
    if len(set(owners.values())) < world:
        return names[me::world]
    return [name for name in names if owners[name] % world == me]


def write_checksums(root: Path, group: Any = None) -> None:
    """After every rank has written its files under ``root`` (and before it is published): each rank hashes its
    share (:func:`_share`), rank 0 writes ``checksums.json``. A collective over ``group`` (the default group when
    None)."""
    me, world = _world(group)
    names = [_files(root) if me == 0 else None]
    if world > 1:  # one listing, so every rank agrees on the shares (a shared file system lists lazily)
        dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    mine = {name: [(root / name).stat().st_size, file_digest(root / name)] for name in _share(names[0], me, world)}
    parts: list[Any] = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=group)
    if me == 0:
        files = {name: entry for part in parts for name, entry in part.items()}
        text = json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=1)
        (root / CHECKSUMS).write_text(text + "\n")


def damaged_files(root: Path, share: tuple[int, int] = (0, 1)) -> list[str] | None:
    """What does not match ``checksums.json`` among rank ``share[0]``'s files of ``share[1]`` ranks (:func:`_share`;
    the default: every file), each as "<file>: <why>"; None when the checkpoint has no checksums."""
    listing = root / CHECKSUMS
    if not listing.is_file():
        return None
    try:
        saved = json.loads(listing.read_text())
        files, algorithm = saved["files"], saved["algorithm"]
    except (ValueError, KeyError, TypeError) as err:
        return [f"{CHECKSUMS}: unreadable ({err})"]
    problems = []
    for name in _share(sorted(files), *share):
        size, digest = files[name]
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, the save wrote {size}")
        elif (found := file_digest(path, algorithm)) != digest:
            problems.append(f"{name}: {_SHOWN.get(algorithm, algorithm)} {found}, the save wrote {digest}")
    return problems


def verify_checkpoint(root: Path) -> None:
    """Check a sharded checkpoint against its checksums before loading it, each rank its share (a collective on
    the default group when one exists). Raises :class:`CheckpointDamaged` on every rank, naming every bad file;
    warns once when the checkpoint has no checksums."""
    me, world = _world(None)
    problems = damaged_files(root, (me, world))
    found: list[Any] = [problems]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, problems)
    if any(p is None for p in found):
        if me == 0:
            warnings.warn(
                f"checkpoint {root} has no {CHECKSUMS} (written before Cuboid kept checksums, or by another tool): it "
                "cannot be verified, and is loaded as it is.",
                stacklevel=2,
            )
        return
    bad = sorted({p for part in found for p in part})
    if bad:
        raise CheckpointDamaged(root, bad)


# --- the format ----------------------------------------------------------------------------------------------
def is_sharded_checkpoint(path: Path) -> bool:
    """A complete DCP directory with Lightning's ``meta.pt`` (Cuboid's, or a Lightning strategy's)."""
    complete = path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()
    return complete and (not isinstance(path, RemotePath) or (path / COMMIT).is_file())


def _save_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    lightning_state: dict[str, Any],
    storage_writer: Callable[[Path], Any] | None = None,
    async_group: dist.ProcessGroup | None = None,
    stager: Any = None,
) -> threading.Thread | None:
    """Write ``path`` atomically: into ``.<name>.tmp``, renamed once every rank is done; on object storage (no
    rename there) under its real name, completed by rank 0's commit marker, written last (:mod:`.storage`).

    With ``async_group`` (a process group used only for checkpoints), the shards are copied to host
    memory (through ``stager``, a DCP ``AsyncStager`` kept across saves so its host buffers are reused),
    written in the background, and the rename happens in a background thread after a
    barrier on that group; the returned thread must be joined before the next save (training
    collectives on the default group and checkpoint collectives never share a group: on gloo they
    deadlocked when they did).
    """
    remote = isinstance(path, RemotePath)
    tmp = path if remote else path.with_name(f".{path.name}.tmp")
    if rank() == 0:
        if remote:  # saved before under this name (last.ckpt): its marker goes first, then the rest
            path.remove_tree()
        elif tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    state = state_dicts(module, optimizers)
    (tmp / RNG_DIR).mkdir(exist_ok=True)
    save_object(collect_rng(), tmp / RNG_DIR / f"rank{rank()}.pt")
    if rank() == 0:
        save_object(lightning_state, tmp / META_FILE)
    writer = (storage_writer(tmp) if storage_writer else None) or (dcp_writer(tmp) if remote else None)
    where = None if remote else tmp  # (a writer with its storage options is never given a checkpoint_id: DCP resets)
    if async_group is None:
        try:
            dcp.save(state, checkpoint_id=where, storage_writer=writer)
        except (Exception, dcp.CheckpointException) as err:  # (a BaseException) raised on every rank by DCP
            raise save_failed(path, tmp, err) from err
        barrier()
        write_checksums(tmp)
        publish(tmp, path)
        barrier()
        return None
    future = dcp.async_save(
        state, checkpoint_id=where, storage_writer=writer, process_group=async_group, async_stager=stager
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
    reader = dcp_reader(path)  # (one reader: its metadata read here, its shards by DCP's load)
    stored = set(reader.read_metadata().state_dict_metadata)
    meta = load_pickled(path / META_FILE, weights_only)
    load_state(path, module, optimizers, strict, stored, storage_reader=reader)
    rng_file = path / RNG_DIR / f"rank{rank()}.pt"
    if rng_file.is_file() and same_world(meta):
        restore_rng(torch.load(readable(rng_file), map_location="cpu", weights_only=True))
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


def latest_checkpoint(directory: str | Path) -> Path | RemotePath | None:
    """The newest complete checkpoint in ``directory`` (what ``ckpt_path="auto"`` resumes from), or None.

    Complete: a sharded checkpoint directory with its metadata, or a ``checkpoint_format="full"`` file; temporary
    (``.<name>.tmp``) and replaced (``.<name>.old``) ones are skipped, and a ``last`` link counts as its target.
    Newest: by the time its metadata was written. ``directory`` may be a URL fsspec reaches (``s3://b/run``): there
    a sharded checkpoint counts once its commit marker is written, and is dated by it.
    """
    found = checkpoints_newest_first(directory)
    return found[0] if found else None


def checkpoints_newest_first(directory: str | Path) -> list[Any]:
    """Every complete checkpoint in ``directory`` (as :func:`latest_checkpoint` counts them), newest first."""
    root = to_path(directory)
    if not root.is_dir():
        return []
    found: dict[Any, float] = {}
    for entry in root.iterdir():
        if entry.name.startswith(".") or not entry.name.endswith(".ckpt"):
            continue
        target = entry.resolve()
        if is_sharded_checkpoint(target):  # on object storage: committed (its marker's time)
            stamp = committed_at(target) if isinstance(target, RemotePath) else (target / META_FILE).stat().st_mtime
            found[target] = stamp or 0.0
        elif target.is_file():  # a full file: one object, whole once it exists
            found[target] = target.stat().st_mtime
    return sorted(found, key=found.__getitem__, reverse=True)
