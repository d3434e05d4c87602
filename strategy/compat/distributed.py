"""The door to torch.distributed's internals: process groups and their timeouts, the flight recorders, device
meshes flattened and unflattened, DTensor's random-number tracker, and the fake process group of dry runs.

Part of :mod:`cuboid.compat` (which re-exports every name here), split off by concern; the same rules hold: each
private name of torch is touched here, with what it is for and why no public API serves, and is pinned in
``tests/test_compat.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def distributed_is_initialized() -> bool:
    """Public torch for Lightning's ``_distributed_is_initialized``."""
    return dist.is_available() and dist.is_initialized()


def default_process_group_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo otherwise (what Lightning's private helper chooses for these two)."""
    return "nccl" if device.type == "cuda" else "gloo"


def start_dtensor_rng(mesh: Any) -> bool:
    """Make DTensor's random-number tracker now, on every rank, where the mesh's device has one (CUDA and alike);
    returns whether one was made. DTensor makes it lazily at the first random op on a DTensor (dropout on a
    sequence-parallel activation, a DTensor init), with a broadcast of rank 0's RNG state over the world: under
    pipeline parallelism only some stages get there, and the others never join that broadcast (a hang). Made here,
    at set-up, every rank joins. ``torch.distributed.tensor._random``'s ``_rng_tracker`` and
    ``OffsetBasedRNGTracker`` are what DTensor's dispatcher reads and makes (torch 2.11 and 2.13); its public
    ``manual_seed`` makes one without the broadcast and needs every rank seeded alike, which Cuboid cannot assume."""
    from torch.distributed.tensor import _random

    if _random._rng_tracker is not None or not _random.is_rng_supported_mesh(mesh):
        return False
    _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=True)
    return True


def default_store() -> Any:
    """The default process group's rendezvous store (a ``TCPStore`` hosted by rank 0's process), which the peer
    watchdog writes its heartbeats to. ``torch.distributed`` keeps it but has no public getter."""
    return dist.distributed_c10d._get_default_store()


def set_group_timeout(group: Any, timeout: Any) -> None:
    """Give ``group`` the collective timeout the user asked for. ``DeviceMesh`` makes its per-dimension groups with
    torch's default timeout (30 min gloo, 10 min NCCL), whatever ``init_process_group(timeout=...)`` said, and takes
    none itself; ``_set_pg_timeout`` is torch's own setter, with no public twin in 2.13."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


# torch's flight recorders: the generic one (gloo and any other backend) and NCCL's own (CUDA builds), each a ring
# of its own with its own record ids, each dumped to Python only as a pickle by these private functions.
_RINGS = (("fr", "_dump_fr_trace"), ("nccl", "_dump_nccl_trace"))


def _ring_dump(name: str, stacks: bool) -> bytes | None:
    from torch._C import _distributed_c10d

    dump = getattr(_distributed_c10d, name, None)
    if dump is None:
        return None
    try:
        return dump(True, stacks, False)
    except RuntimeError:  # a recorder this process never started
        return None


def flight_recorder_entries() -> list[dict[str, Any]]:
    """This process's flight-recorder entries (the last collectives it issued, when ``TORCH_FR_BUFFER_SIZE`` was set
    before the first one), from both of torch's recorders: the generic one, which gloo writes, and NCCL's own,
    which NCCL process groups write in CUDA builds (``_dump_fr_trace`` alone reads none of NCCL's). Each entry has
    ``ring`` ("fr" or "nccl": record ids count per ring), ``record_id``, ``process_group`` (name, desc),
    ``profiling_name`` (e.g. ``"gloo:all_gather"``, ``"nccl:all_reduce"``), ``collective_seq_id``, ``input_sizes``,
    ``time_created_ns`` and ``retired``; oldest first."""
    import pickle

    entries: list[dict[str, Any]] = []
    for ring, name in _RINGS:
        raw = _ring_dump(name, stacks=False)
        if raw is not None:
            entries += [{**entry, "ring": ring} for entry in pickle.loads(raw).get("entries", [])]
    entries.sort(key=lambda entry: (entry.get("time_created_ns", 0), entry["ring"], entry["record_id"]))
    return entries


def flight_recorder_dump(ring: str = "fr") -> bytes | None:
    """One recorder's ring with stack traces, pickled as torch's ``fr_trace`` analyzer reads it (``ring``: "fr",
    the generic one, or "nccl"); None where this build has no such recorder."""
    return _ring_dump(dict(_RINGS)[ring], stacks=True)


class PointToPointCounter(TorchDispatchMode):
    """Counts the ``c10d`` send and recv ops issued while it is entered (``with counter:``), and their tensors'
    bytes. ``TorchDispatchMode`` (torch.utils._python_dispatch) has no public twin; the ledger uses this on gloo,
    whose send/recv torch 2.13's flight recorder leaves out. Pinned end to end by tests/test_ledger.py (pp2 on
    gloo: 8 sends and receives per stage, the analytic bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "c10d" and func.__name__.split(".")[0] in ("send", "recv_"):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.count += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A named 1-D view of some mesh dims. ``DeviceMesh._flatten`` has no public twin in torch 2.11 or 2.13;
    torchtitan uses it the same way. Both warn that looking a flattened dim up by name on the root mesh "will be
    deprecated" and ask callers to keep the flattened mesh themselves: Cuboid does (``cuboid.parallel.mesh.submesh``);
    only a user's ``mesh["data_parallel"]`` (ModelParallelStrategy's name) still takes torch's lookup (pinned in
    tests/test_compat.py)."""
    return mesh._flatten(name)


def name_mesh(view: Any, name: str) -> Any:
    """The 1-D mesh ``view`` under the name ``name``, over ``view``'s own process group, registered on its root mesh
    as a flattened dim (so that ``root[name]`` finds it): what ``view._flatten(name)`` gives where ``view`` is already
    the dims to flatten, without the new process group ``_flatten`` makes every time (torch 2.11 and 2.13 dedupe
    none: each is one more NCCL communicator, made at once where the default group is bound to a device). torch has
    no public way to name a view; this builds the ``DeviceMesh`` as ``_create_sub_mesh`` does (``_init_backend=False``,
    the group names copied) and files it where ``_create_flatten_mesh`` files its own (``_flatten_mapping``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if view.ndim != 1:
        raise ValueError(f"name_mesh takes a 1-D mesh, got {view.ndim} dims ({view.mesh_dim_names})")
    root = view._get_root_mesh()
    layout = view._layout  # as _create_flatten_mesh lays out a flattened dim, so that root[name] can slice it
    if hasattr(layout, "collapse"):  # torch 2.13: _MeshLayout([layout.collapse()])
        layout = type(layout)([layout.collapse()])
    else:  # torch 2.11: layout.coalesce(), nested past one mode
        layout = layout.coalesce()
        layout = layout.nest() if len(layout) > 1 else layout
    named = DeviceMesh(
        view.device_type,
        _layout=layout,
        _rank_map=root._rank_map,
        mesh_dim_names=(name,),
        _root_mesh=root,
        _init_backend=False,
    )
    named._dim_group_names = list(view._dim_group_names)
    root._flatten_mapping[name] = named
    return named


def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A 1-D mesh split into ``len(sizes)`` named dims (``DeviceMesh._unflatten``, torch 2.11 and 2.13; no public
    twin): how a 2-D view whose inner dim is itself flattened (HSDP's ``dp_replicate x dp_shard_cp``) is made without
    slicing a flattened name from the root mesh."""
    return mesh._unflatten(0, sizes, names)


def init_fake_process_group(world_size: int) -> None:
    """A process group of ``world_size`` ranks held by this one process, whose collectives do nothing (torch's
    ``fake`` backend, from ``torch.testing``): enough to build meshes and shard meta tensors for a dry run."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def full_tensor(value: Any) -> torch.Tensor:
    """``value.full_tensor()`` (a DTensor, detached), gathered on its mesh's device, where the result lies. FSDP2's
    offloaded shards (``cpu_offload=True``) are DTensors whose local tensors are on the host while their mesh's groups
    are NCCL, which serves device tensors only (``ProcessGroup::getBackend`` has no backend for ``cpu``): such a
    shard is copied to the mesh's device first (``DTensor.from_local`` moves it there), one parameter at a time."""
    from torch.distributed.tensor import DTensor

    value = value.detach()
    local, mesh = value.to_local(), value.device_mesh
    if local.device.type != mesh.device_type:
        value = DTensor.from_local(local, mesh, value.placements, shape=value.shape, stride=value.stride())
    return value.full_tensor()


def on_group_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` where a collective over a group of ``device``'s backend can take it: itself when on ``device``'s
    type, else a copy there (a host tensor never reaches NCCL). Copy the result back when the collective wrote it."""
    return tensor if tensor.device.type == device.type else tensor.to(device)


def all_gather_single(output: Any, local: Any, group: Any = None) -> None:
    """Every rank's ``local`` into ``output`` (``world x local`` along dim 0), one collective: torch 2.13 names it
    ``all_gather_single`` and warns (FutureWarning) on the older ``all_gather_into_tensor``, which torch 2.11 alone
    has."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def reduce_scatter_single(output: Any, stacked: Any, group: Any = None) -> None:
    """The sum over ranks of ``stacked``'s rank-th slice (dim 0) into ``output``: ``reduce_scatter_single`` in
    torch 2.13, ``reduce_scatter_tensor`` (deprecated there) in torch 2.11."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, stacked, group=group)


def fsdp_unreduced(unit: Any) -> bool:
    """Whether an FSDP2 unit holds gradients reduce-scattered on earlier microbatches but not yet all-reduced across
    HSDP's replicas (FSDP's per-group ``_partial_reduce_output``, set while ``set_requires_all_reduce(False)`` and
    folded in by the next backward that all-reduces): after a step's last backward, a unit that got no gradient
    there keeps it. torch 2.13 keeps a list of parameter groups (``_fsdp_param_groups``), 2.11 one
    (``_fsdp_param_group``). No public API says it."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return any(getattr(group, "_partial_reduce_output", None) is not None for group in groups)


# --- DCP on fsspec file systems (s3://, gs://, memory://, ...) ----------------------------------------------------
# torch's FsspecWriter/FsspecReader live in a private module (torch 2.11-2.13: not exported from
# torch.distributed.checkpoint; pytorch/pytorch#188629 exports them). DCP picks them by itself for a URL given as
# checkpoint_id, but then without storage options and with sync_files=True (an os.sync() of the whole host per file:
# an fsspec file has no fileno). Built here with the options, and never passed a checkpoint_id beside them: DCP's
# reset(checkpoint_id) rebuilds the file system without the options.
def fsspec_writer(url: str, storage_options: dict[str, Any]) -> Any:
    """A DCP storage writer into ``url`` through fsspec, ``storage_options`` passed to the file system."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, sync_files=False, **storage_options)


def fsspec_reader(url: str, storage_options: dict[str, Any]) -> Any:
    """A DCP storage reader of ``url`` through fsspec."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **storage_options)
