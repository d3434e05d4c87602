"""Consolidated checkpoints (``checkpoint_format="full"``): one file, written by rank 0, that resumes.

The sharded format (:mod:`cuboid.checkpoint.sharded`) is the default and scales to any model. The full
format is for models whose weights and optimizer state fit in one host's memory: it gathers the
state *parameter by parameter* (each gathered on the accelerator, copied to rank 0's host memory,
then freed, so no accelerator ever holds more than one gathered parameter), pipeline stages
sending their share to rank 0, and writes one ``torch.save`` file, atomically (temporary name,
then rename).

The file is a Lightning checkpoint: ``state_dict`` holds the LightningModule's weights by their
usual names and ``optimizer_states`` each optimizer's state in ``torch.optim``'s own format (by
parameter position, see :mod:`cuboid.checkpoint.lightning`), so plain Lightning resumes it, optimizer
included, and ``LightningModule.load_from_checkpoint`` reads it anywhere. Each rank's RNG state sits
under ``"cuboid"``. Loading reshards onto any layout: every rank memory-maps the file and copies out
its own slices through DCP's resharding planner. The same loader reads plain Lightning checkpoints
(DDP, ModelParallelStrategy and FSDPStrategy full files).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.futures import Future
from torch.optim import Optimizer

from cuboid import compat
from cuboid.checkpoint import lightning as lightning_format
from cuboid.checkpoint.format import (
    CheckpointError,
    LiveWeights,
    LoadRequest,
    SaveRequest,
    collect_rng,
    load_pickled,
    load_state,
    publish,
    rank,
    restore_rng,
    same_world,
    state_dicts,
)
from cuboid.storage import RemotePath, save_object

FORMAT = "full"


def _save_full(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    lightning_state: dict[str, Any],
    mesh: DeviceMesh,
    group: dist.ProcessGroup | None,
    background: bool = False,
    model_order: Sequence[str] | None = None,
    checkpoint_io: Any = None,
) -> threading.Thread | None:
    """Gather model and optimizer state to rank 0's host memory and write ``path`` (one file).

    ``group`` is a gloo group over all ranks (``None``: the default group, when it is gloo): the
    pipeline stages' shares travel to rank 0 through it as host tensors. With ``background``, rank
    0 writes the file in a thread (returned; join it before the next save), after the gather.
    ``model_order``: the model's parameter names before a pipeline split (``None`` without one).
    ``checkpoint_io``: a user's CheckpointIO plugin, whose ``save_checkpoint`` writes the file instead.
    """
    for unit in compat.fsdp_units(module):  # a unit left gathered after a forward (the root, under pp, a unit kept
        unit.reshard()  # whole) holds its gathered parameters: its sharded ones, which the optimizers hold, again
    groups = lightning_format.optimizer_groups(module, optimizers, model_order)
    gathered = _gather_to_rank0(state_dicts(module, optimizers), mesh, group)
    rng = [None] * dist.get_world_size() if rank() == 0 else None
    dist.gather_object(collect_rng(), rng, dst=0, group=group)
    if rank() != 0:
        return None
    assert gathered is not None
    payload = dict(lightning_state)
    live = gathered.pop("model")
    payload["state_dict"] = payload.get("state_dict") or live  # or a callback's own weights (WeightAveraging's)
    payload.update({key: live for key, value in payload.items() if isinstance(value, LiveWeights)})  # moved there
    if optimizers:  # none for ModelCheckpoint(save_weights_only=True): leave the key out, as Lightning does
        payload["optimizer_states"] = [
            lightning_format.to_positional(
                gathered[f"optimizer_{i}"],
                groups[i],
                [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            )
            for i, opt in enumerate(optimizers)
        ]
    payload["cuboid"] = {**payload.get("cuboid", {}), "format": FORMAT, "rng": rng}

    def write() -> None:
        if checkpoint_io is not None:  # as Lightning's strategies write it: rank 0, through the plugin
            checkpoint_io.save_checkpoint(payload, str(path))
            return
        if isinstance(path, RemotePath):  # one object, written whole by one PUT: no temporary name needed
            save_object(payload, path)
            return
        tmp = path.with_name(f".{path.name}.tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)

    if not background:
        write()
        return None
    thread = threading.Thread(target=write, name=f"cuboid-save-{path.name}", daemon=True)
    thread.start()
    return thread


def _gather_to_rank0(state: dict[str, Any], mesh: DeviceMesh, group: dist.ProcessGroup | None) -> dict | None:
    """Full tensors of every stage, by name, on rank 0's host; ``None`` on other ranks.

    Within a pipeline stage every rank holds the same names in the same order: each DTensor is
    gathered over its own mesh (one parameter at a time) and the stage's first rank keeps a host
    copy. Then each later stage's first rank sends its share to rank 0 (names first, then tensors).
    """
    coords = mesh.get_coordinate()
    assert coords is not None
    share = _gathered(state, keep=all(c == 0 for c in coords[1:]))
    leads = [int(r) for r in mesh.mesh.reshape(mesh.mesh.shape[0], -1)[:, 0].tolist()]
    if rank() in leads[1:]:
        _send_share(share, group)
        return None
    if rank() != 0:
        return None
    for lead in leads[1:]:
        for part, entries in _recv_share(lead, group).items():
            share.setdefault(part, {}).update(entries)
    return share


def _gathered(state: dict[str, Any], keep: bool) -> dict[str, dict[str, Any]]:
    """Each DTensor of ``state`` gathered over its own mesh, one at a time (every rank of the stage gathers, in the
    same order), through the mesh's device when its shard lives on the host (``cpu_offload``); host copies of
    everything when ``keep`` (the stage's first rank), else empty parts."""
    share: dict[str, dict[str, Any]] = {}
    for part, entries in state.items():
        mine = share.setdefault(part, {})
        for key, value in entries.items():
            if isinstance(value, DTensor):
                full = compat.full_tensor(value)
                if keep:
                    mine[key] = full.detach().to("cpu", copy=True)
                del full
            elif keep:
                mine[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
    return share


def _send_share(share: dict[str, dict[str, Any]], group: dist.ProcessGroup | None) -> None:
    header = {
        part: {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("object", v) for k, v in entries.items()}
        for part, entries in share.items()
    }
    dist.send_object_list([header], dst=0, group=group)
    for entries in share.values():
        for value in entries.values():
            if torch.is_tensor(value):
                dist.send(_as_bytes(value), dst=0, group=group)


def _recv_share(src: int, group: dist.ProcessGroup | None) -> dict[str, dict[str, Any]]:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    share: dict[str, dict[str, Any]] = {}
    for part, entries in box[0].items():
        out = share.setdefault(part, {})
        for key, (shape, kind) in entries.items():
            if shape == "object":
                out[key] = kind
                continue
            value = torch.empty(shape, dtype=kind)
            dist.recv(_as_bytes(value), src=src, group=group)
            out[key] = value
    return share


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view (gloo sends bytes of any dtype this way, bf16 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def load_full(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    weights_only: bool | None = None,
    model_order: Sequence[str] | None = None,
    checkpoint_io: Any = None,
) -> dict[str, Any]:
    """Load a full checkpoint into the current layout (any pp x dp x tp, or one process).

    Reads Cuboid's full files and plain Lightning checkpoints (DDP, ModelParallelStrategy, FSDPStrategy):
    ``state_dict`` by the LightningModule's names, ``optimizer_states`` in ``torch.optim``'s format. Every
    rank memory-maps the file (pages are shared and read on demand) and copies out the slices it owns;
    returns Lightning's state, without the tensors. ``checkpoint_io``: a user's CheckpointIO plugin, whose
    ``load_checkpoint`` reads the file instead (every rank, as under Lightning's DDP).
    """
    if checkpoint_io is not None:
        payload = checkpoint_io.load_checkpoint(str(path), weights_only=weights_only)
    else:
        payload = load_pickled(path, weights_only, mmap=True)
    if not isinstance(payload, dict) or not isinstance(payload.get("state_dict"), dict):
        raise CheckpointError(
            f"{path} is a file without a 'state_dict': not a Lightning checkpoint. Cuboid resumes its own sharded "
            "directories and full files, and Lightning's (DDP, ModelParallelStrategy, FSDPStrategy) checkpoints."
        )
    extra = payload.get("cuboid", {})
    saved = payload.pop("optimizer_states", None)
    if optimizers and saved is not None and len(saved) != len(optimizers):
        raise CheckpointError(
            f"{path} holds {len(saved)} optimizer states but the LightningModule configures {len(optimizers)}."
        )
    stored_opts: list[dict[str, Any]] = []
    if optimizers and saved:
        groups = lightning_format.optimizer_groups(module, optimizers, model_order)
        try:
            stored_opts = [
                lightning_format.from_positional(o, g, str(path)) for o, g in zip(saved, groups, strict=True)
            ]
        except lightning_format.FormatError as err:
            raise CheckpointError(str(err)) from None
    stored = {"model": payload.pop("state_dict"), **{f"optimizer_{i}": s for i, s in enumerate(stored_opts)}}
    if "current_model_state" in payload:  # WeightAveraging's: its on_load_checkpoint reads its average there too
        payload["state_dict"] = stored["model"]
    reader = _MappedReader(stored)
    load_state(path, module, optimizers, strict, set(reader.flat), storage_reader=reader)
    rng = extra.pop("rng", None)
    if rng is not None and same_world(payload):
        restore_rng(rng[rank()])
    return payload


class FullFormat:
    """``checkpoint_format="full"``: one file on rank 0, a Lightning checkpoint (models whose state fits in one
    host's memory). Also reads Lightning's own full files (DDP, ModelParallelStrategy, FSDPStrategy)."""

    name = "full"
    needs_gloo_group = True  # pipeline stages send their share to rank 0 as host tensors

    def recognizes(self, path: Path) -> bool:
        return path.is_file()

    def save(self, request: SaveRequest) -> threading.Thread | None:
        # (gathered to rank 0 and written from there: no DCP staging, no storage writer)
        r = request
        return _save_full(
            r.path, r.module, r.optimizers, r.lightning_state, r.mesh, r.group, r.background, r.model_order,
            r.checkpoint_io,
        )  # fmt: skip

    def load(self, request: LoadRequest) -> dict[str, Any]:
        r = request
        return load_full(r.path, r.module, r.optimizers, r.strict, r.weights_only, r.model_order, r.checkpoint_io)


class _MappedReader(StorageReader):
    """A DCP storage reader over an in-memory (memory-mapped) nested state dict of full tensors.

    Each tensor is one chunk covering the whole tensor, so DCP's planner asks every rank for
    exactly the slices its local shards need, in any layout.
    """

    def __init__(self, state: dict[str, dict[str, Any]]) -> None:
        self.flat = {f"{part}.{key}": value for part, entries in state.items() for key, value in entries.items()}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        entries: dict[str, Any] = {}
        for key, value in self.flat.items():
            if torch.is_tensor(value) or hasattr(value, "region"):  # (a PackedExperts: built region by region)
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.size())
                entries[key] = TensorStorageMetadata(TensorProperties(dtype=value.dtype), value.size(), [chunk])
            else:
                entries[key] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=entries)

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        for item in plan.items:
            value = self.flat[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(value, buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            if hasattr(value, "region"):  # a PackedExperts: only the experts of this region are read
                source = value.region(item.storage_offsets, item.lengths)
            else:
                source = value
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    source = source.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: Any) -> Any:
        return plans

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True
