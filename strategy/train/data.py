"""Local text as training data: byte-level tokens in a memory-mapped file, and a DataModule.

Byte-level tokens (vocabulary 256) need no tokenizer download, so the default run trains on
real text already on the machine: the Python standard library's own source files.
``python scripts/prepare_data.py PATH... --out tokens.bin`` turns any text files or folders
into a token file; ``TokenDataModule(path=...)`` trains on it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

DEFAULT_PATTERNS = ("*.py", "*.txt", "*.md", "*.rst")


class DataError(ValueError):
    """Data that cannot train: the message names the config key and the fix."""


def stdlib_sources() -> Path:
    """The folder with the Python standard library's source (site-packages excluded by prepare)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(paths: Sequence[Path], patterns: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            for pattern in patterns:
                files.extend(p for p in path.rglob(pattern) if "site-packages" not in p.parts and p.is_file())
        else:
            raise DataError(f"data source {str(path)!r} does not exist: pass existing text files or folders.")
    return sorted(set(files))


def prepare_tokens(
    sources: Sequence[str | Path],
    out: str | Path,
    max_bytes: int | None = None,
    patterns: Iterable[str] = DEFAULT_PATTERNS,
    tokenizer: str | Path | None = None,
) -> tuple[Path, int]:
    """Concatenate the UTF-8 bytes of text files into ``out`` (one uint8 token per byte), or, with ``tokenizer``
    (a Hugging Face model or tokenizer directory: the model you fine-tune), their token ids as uint32 with a
    ``<out>.json`` beside it saying so (``max_bytes`` then caps tokens).

    Files are read in sorted order and separated by a blank line, so the same sources always give
    the same file. Writes to a temporary file of this process and renames it when complete, so
    processes preparing the same file at once (one per node on a shared filesystem) each replace it
    whole with the same bytes. Returns (path, tokens).
    """
    out = Path(out)
    files = _text_files([Path(s) for s in sources], patterns)
    if not files:
        raise DataError(f"no text files matching {list(patterns)} under {[str(s) for s in sources]}.")
    # Host and pid: two nodes on a shared filesystem may prepare the same file at once (pids repeat across nodes).
    tmp = out.with_name(f".{out.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        return _prepare_with_tokenizer(files, out, tmp, max_bytes, tokenizer)
    written = 0
    with open(tmp, "wb") as fh:
        for path in files:
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue  # not text
            chunk = data + b"\n\n"
            if max_bytes is not None and written + len(chunk) > max_bytes:
                chunk = chunk[: max_bytes - written]
            fh.write(chunk)
            written += len(chunk)
            if max_bytes is not None and written >= max_bytes:
                break
    tmp.replace(out)
    return out, written


def _prepare_with_tokenizer(
    files: list[Path], out: Path, tmp: Path, max_tokens: int | None, tokenizer: str | Path
) -> tuple[Path, int]:
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    written = 0
    with open(tmp, "wb") as fh:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            ids = np.asarray(tok(text + "\n\n", add_special_tokens=False)["input_ids"], dtype=np.uint32)
            if max_tokens is not None:
                ids = ids[: max_tokens - written]
            ids.tofile(fh)
            written += len(ids)
            if max_tokens is not None and written >= max_tokens:
                break
    meta = {"dtype": "uint32", "vocab_size": len(tok), "tokenizer": str(tokenizer)}
    Path(f"{tmp}.json").write_text(json.dumps(meta))
    Path(f"{tmp}.json").replace(f"{out}.json")
    tmp.replace(out)
    return out, written


def load_tokens(path: str | Path) -> np.memmap:
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"data.path={str(path)!r} does not exist. Create it with `python scripts/prepare_data.py SOURCES --out "
            f"{path}`, or use data=stdlib."
        )
    if path.stat().st_size == 0:
        raise DataError(f"data.path={str(path)!r} is empty (0 tokens). Re-run scripts/prepare_data.py on real text.")
    sidecar = Path(f"{path}.json")  # written by prepare_data --tokenizer: token ids wider than a byte
    if sidecar.is_file():
        import json

        return np.memmap(path, dtype=np.dtype(json.loads(sidecar.read_text())["dtype"]), mode="r")
    return np.memmap(path, dtype=np.uint8, mode="r")


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


class TokenDataModule(L.LightningDataModule):
    """Train/validation split of a byte-token file (the tail ``val_fraction`` is validation).

    Args:
        path: Token file from ``scripts/prepare_data.py``. ``None``: build one from ``sources``.
        sources: Text files or folders used when ``path`` is ``None`` (default: Python's stdlib).
        cache_dir: Where a token file built from ``sources`` is kept.
        max_bytes: Cap on tokens read from ``sources`` (keeps the default run small).
        seq_len: Tokens per sample (the model sees ``seq_len`` inputs, predicts the next of each).
        batch_size: Samples per data-parallel rank per step.
        val_fraction: Share of the file held out for validation.
        val_multiple: The validation set is trimmed to a multiple of this many samples, so every
            data-parallel size dividing it sees exactly the same validation samples (no padding).
    """

    def __init__(
        self,
        path: str | None = None,
        sources: Sequence[str] | None = None,
        cache_dir: str = ".cache/cuboid",
        max_bytes: int | None = 4_000_000,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        val_multiple: int = 8,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.path, self.sources, self.cache_dir, self.max_bytes = path, sources, cache_dir, max_bytes
        self.seq_len, self.batch_size, self.val_fraction, self.val_multiple = (
            seq_len,
            batch_size,
            val_fraction,
            val_multiple,
        )
        self.num_workers = num_workers
        if path is not None:
            load_tokens(path)  # fail now, before any process group starts, if it is missing or empty
        else:
            self.sources = list(sources) if sources else [str(stdlib_sources())]
            for source in self.sources:
                if not Path(source).exists():
                    raise DataError(
                        f"data.sources entry {source!r} does not exist: pass existing text files or folders."
                    )

    @property
    def token_path(self) -> Path:
        if self.path is not None:
            return Path(self.path)
        key = hashlib.sha1(repr((sorted(self.sources or ()), self.max_bytes)).encode()).hexdigest()[:12]
        return Path(self.cache_dir) / f"tokens-{key}.bin"

    def prepare_data(self) -> None:
        if self.path is None and not self.token_path.is_file():
            prepare_tokens(self.sources or [], self.token_path, self.max_bytes)

    def setup(self, stage: str | None = None) -> None:
        tokens = load_tokens(self.token_path)
        n_val = int(len(tokens) * self.val_fraction)
        self.train_set = TokenWindows(tokens[: len(tokens) - n_val], self.seq_len)
        val = TokenWindows(tokens[len(tokens) - n_val :], self.seq_len)
        keep = len(val) - len(val) % self.val_multiple
        self.val_set = torch.utils.data.Subset(val, range(keep))
        if len(self.train_set) == 0:
            raise DataError(
                f"{self.token_path} holds {len(tokens)} tokens, fewer than one training sample of seq_len="
                f"{self.seq_len} + 1. Use more text or a smaller data.seq_len."
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, drop_last=True,
            pin_memory=_pin(),
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers, pin_memory=_pin())


def _pin() -> bool:
    """Batches in page-locked host memory where a GPU will take them: Lightning then copies them to the device with
    ``non_blocking=True``, and the copy does not hold up the host (from pageable memory it is synchronous)."""
    return torch.cuda.is_available()
