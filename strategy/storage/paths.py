"""Where checkpoints lie: a local directory, or anywhere fsspec reaches (``s3://``, ``gs://``, ``az://``, ...).

A URL is a :class:`RemotePath`: the few ``pathlib.Path`` methods the checkpoint formats use, over an fsspec file
system, so one code path writes both. What cannot carry over is decided here:

* **No rename on object storage.** S3 and its kin have no atomic rename of an object or a prefix (s3fs's ``mv`` is
  a copy then a delete), so a local save's "write under a hidden name, rename when complete" has no twin. A remote
  checkpoint is written under its real name and is complete only once rank 0 writes the commit marker
  (:data:`COMMIT`, a small JSON object) as the save's very last object, after every rank's shards, the metadata and
  the checksums. ``ckpt_path="auto"`` and every load refuse a remote checkpoint without it; a save that dies midway
  leaves a prefix without it. A checkpoint saved again under the same name (``last.ckpt``) loses its marker first.
* **Listings may be cached.** fsspec file systems keep directory listings; every query here drops them first, so a
  checkpoint another process wrote is seen.
* **Credentials and endpoints** come from the environment as for every fsspec user (``AWS_ENDPOINT_URL``,
  ``AWS_ACCESS_KEY_ID``, ...; Lightning's own ``ModelCheckpoint`` reads them that way), or per save from
  ``trainer.save_checkpoint(..., storage_options={...})``.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

import torch

COMMIT = ".cuboid-complete"  # a remote checkpoint's commit marker: written last, by rank 0
_LOCAL = ("file", "local")


class RemotePath:
    """A checkpoint path on an fsspec file system, with the ``pathlib.Path`` methods the formats use. No
    ``__fspath__``: an ``open()`` or ``os`` call on one fails at once instead of writing a local ``s3:/`` folder."""

    def __init__(self, url: str, fs: Any = None, options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.options = dict(options or {})
        self.fs = fs if fs is not None else fsspec.core.url_to_fs(url, **self.options)[0]
        self.url = url.rstrip("/")

    def _at(self, url: str) -> RemotePath:
        return RemotePath(url, self.fs, self.options)

    # --- names
    def __truediv__(self, name: str | os.PathLike) -> RemotePath:
        return self._at(f"{self.url}/{os.fspath(name).strip('/')}")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return self._at(self.url.rsplit("/", 1)[0])

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        return PurePosixPath(self.url[len(other.url) :].lstrip("/"))

    def as_posix(self) -> str:
        return self.url

    def resolve(self) -> RemotePath:
        return self

    def absolute(self) -> RemotePath:
        return self

    # --- queries (listings dropped first: another process may have written since)
    def _fresh(self) -> Any:
        self.fs.invalidate_cache()
        return self.fs

    def exists(self) -> bool:
        return bool(self._fresh().exists(self.url))

    def is_file(self) -> bool:
        return bool(self._fresh().isfile(self.url))

    def is_dir(self) -> bool:
        return bool(self._fresh().isdir(self.url))

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[RemotePath]:
        mine = _key(self.url)
        for entry in self._fresh().ls(self.url, detail=False):
            if entry.rstrip("/") != mine:
                yield self._at(self.fs.unstrip_protocol(entry.rstrip("/")))

    def files(self) -> list[str]:
        """Every file below this prefix, by its name relative to it (``rng/rank0.pt``)."""
        mine = _key(self.url)
        return sorted(entry[len(mine) :].lstrip("/") for entry in self._fresh().find(self.url))

    def stat(self) -> SimpleNamespace:
        info = self._fresh().info(self.url)
        stamp = info.get("LastModified", info.get("mtime", info.get("created", 0.0)))
        return SimpleNamespace(st_size=int(info.get("size") or 0), st_mtime=_seconds(stamp))

    # --- contents
    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.url, mode)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.url)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.url, data)  # one PUT: a reader sees the whole object or none

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        pass  # object stores have no folders: a prefix exists through its objects

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self.fs.rm_file(self.url)

    def remove_tree(self) -> None:
        """Remove everything under this prefix, the commit marker first: a half-removed checkpoint is never
        complete."""
        marker = self / COMMIT
        if marker.exists():
            marker.unlink()
        if self.exists():
            self.fs.rm(self.url, recursive=True)


def _key(url: str) -> str:
    """A URL as its file system lists it (the protocol left out)."""
    import fsspec

    return fsspec.core.strip_protocol(url).rstrip("/")


def _seconds(stamp: Any) -> float:
    if hasattr(stamp, "timestamp"):
        return float(stamp.timestamp())
    return float(stamp or 0.0)


def is_remote(value: Any) -> bool:
    """True for a URL of a file system other than the local one (``s3://b/run``), or a :class:`RemotePath`."""
    if isinstance(value, RemotePath):
        return True
    if not isinstance(value, str) or "://" not in value:
        return False
    import fsspec

    return fsspec.utils.get_protocol(value) not in _LOCAL


def to_path(value: str | os.PathLike | RemotePath, storage_options: dict[str, Any] | None = None) -> Any:
    """A checkpoint location as the formats take it: a ``Path``, or a :class:`RemotePath` for a URL (keep URLs as
    strings until here: ``Path("s3://b/x")`` is the local ``s3:/b/x``)."""
    if isinstance(value, RemotePath):
        return value
    text = os.fspath(value)
    if is_remote(text):
        return RemotePath(text, options=storage_options)
    if storage_options:
        raise TypeError(
            f"storage_options={storage_options!r} are for a checkpoint path that fsspec reaches (s3://, gs://, ...); "
            f"{text} is a local path. Leave them out."
        )
    return Path(text.removeprefix("file://"))


def save_object(obj: Any, path: Any) -> None:
    """``torch.save`` to a local or remote path (remote: one object, written whole)."""
    if isinstance(path, RemotePath):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        path.write_bytes(buffer.getvalue())
    else:
        torch.save(obj, path)


def readable(path: Any) -> Any:
    """What ``torch.load`` takes for ``path``: the path itself, or a remote object's bytes in memory."""
    return io.BytesIO(path.read_bytes()) if isinstance(path, RemotePath) else path


def commit(path: RemotePath) -> None:
    """Rank 0's last write of a remote checkpoint: the marker that makes it complete."""
    (path / COMMIT).write_text(json.dumps({"saved_at": time.time()}))


def committed_at(path: RemotePath) -> float | None:
    """When a remote checkpoint was committed (its marker's time), or None without a marker."""
    marker = path / COMMIT
    try:
        return float(json.loads(marker.read_text())["saved_at"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def dcp_writer(path: Any) -> Any:
    """DCP's writer for a remote checkpoint (local ones: DCP's default from the path)."""
    from cuboid import compat

    return compat.fsspec_writer(path.url, path.options)


def dcp_reader(path: Any) -> Any:
    """DCP's reader of a checkpoint, local or remote."""
    import torch.distributed.checkpoint as dcp

    from cuboid import compat

    if isinstance(path, RemotePath):
        return compat.fsspec_reader(path.url, path.options)
    return dcp.FileSystemReader(path)
