"""Read an offline W&B run file (``run-*.wandb``) back into its protobuf Records.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks of records, each with a 7-byte header (CRC32, length, type) and a chunk of a
serialized ``wandb_internal_pb2.Record``; a record too long for a block is split into
FIRST/MIDDLE/LAST chunks. wandb 0.31 ships the protobufs but no reader, hence this one.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, (ident, magic, version)
    records, pending, pos = [], b"", 7
    while pos + HEADER.size <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER.size:
            pos += left_in_block
            continue
        crc, length, kind = HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:
            pos += left_in_block  # zero padding to the end of the block
            continue
        chunk = data[pos + HEADER.size : pos + HEADER.size + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"bad CRC at byte {pos}"
        pos += HEADER.size + length
        if kind == FULL:
            pending = chunk
        elif kind == FIRST:
            pending = chunk
            continue
        elif kind == MIDDLE:
            pending += chunk
            continue
        else:
            pending += chunk
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        records.append(record)
        pending = b""
    return records


def history(records: list[wandb_internal_pb2.Record]) -> list[dict[str, Any]]:
    """Every ``wandb.log`` row, as {key: value}."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def config(records: list[wandb_internal_pb2.Record]) -> dict[str, Any]:
    """The run's config (later updates win)."""
    out: dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            for item in r.config.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
