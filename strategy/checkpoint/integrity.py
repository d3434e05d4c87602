"""Checkpoints that prove themselves: a checksum of every file a sharded save writes, verified on load.

torch's DCP keeps no checksums: a shard damaged on disk (bit rot, a torn copy between file systems) loads without a
word and is trained on. Cuboid's sharded save ends, before the directory gets its real name, with every rank hashing
its share of the files (every ``world``-th file of the sorted list: DCP's shards, ``.metadata``, ``meta.pt``, the
RNG states), and rank 0 writing their sizes and CRC-32s to ``checksums.json``. A load first checks them, each rank
its share again, and stops before any weight is read with :class:`CheckpointDamaged`, which names every damaged or
missing file and the checkpoint. A checkpoint without ``checksums.json`` (written before Cuboid kept them, or by
another tool) loads with a warning that it cannot be verified.

CRC-32 (``zlib``, several GB/s) finds bit rot and torn or truncated copies; it is not a defence against someone
who changes a file on purpose.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from cuboid.checkpoint.format import CheckpointError

CHECKSUMS = "checksums.json"
_CHUNK = 1 << 24


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


def crc32_of(path: Path) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def _world(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def write_checksums(root: Path, group: Any = None) -> None:
    """After every rank has written its files under ``root`` (and before it is published): each rank hashes its
    share, rank 0 writes ``checksums.json``. A collective over ``group`` (the default group when None)."""
    me, world = _world(group)
    names = [_files(root) if me == 0 else None]
    if world > 1:  # one listing, so every rank agrees on the shares (a shared file system lists lazily)
        dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    mine = {name: [(root / name).stat().st_size, crc32_of(root / name)] for name in names[0][me::world]}
    parts: list[Any] = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=group)
    if me == 0:
        files = {name: entry for part in parts for name, entry in part.items()}
        text = json.dumps({"algorithm": "crc32", "files": dict(sorted(files.items()))}, indent=1)
        (root / CHECKSUMS).write_text(text + "\n")


def damaged_files(root: Path, share: tuple[int, int] = (0, 1)) -> list[str] | None:
    """What does not match ``checksums.json`` among the files of ``share`` (``(index, count)``: every count-th
    file from index), each as "<file>: <why>"; None when the checkpoint has no checksums."""
    listing = root / CHECKSUMS
    if not listing.is_file():
        return None
    try:
        files = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        return [f"{CHECKSUMS}: unreadable ({err})"]
    index, count = share
    problems = []
    for name in sorted(files)[index::count]:
        size, crc = files[name]
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, the save wrote {size}")
        elif crc32_of(path) != crc:
            problems.append(f"{name}: CRC-32 {crc32_of(path)}, the save wrote {crc}")
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
        rank_zero_warn(
            f"checkpoint {root} has no {CHECKSUMS} (written before Cuboid kept checksums, or by another tool): it "
            "cannot be verified, and is loaded as it is."
        )
        return
    bad = sorted({p for part in found for p in part})
    if bad:
        raise CheckpointDamaged(root, bad)
