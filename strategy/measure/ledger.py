"""The communication ledger: per optimizer step, the count and bytes of each collective kind per mesh dimension.

``Trainer(callbacks=[CommLedger()])`` (off by default; the main job's ``debug`` preset turns it on). It reads
torch's flight recorder, which Cuboid keeps on (``CuboidStrategy(flight_recorder=...)``): every collective this
rank issued since the previous step, with its process group's description (``mesh_tp``, ``mesh_dp_shard``, ...;
Cuboid's own gloo group is ``cuboid_host``), its kind and its tensors' sizes and dtypes. Bytes are those of the
full tensor: the gathered output of an all-gather, the input of a reduce-scatter, all-reduce or send/recv (so a
ring moves about ``(n - 1) / n`` of them per rank). On logging steps rank 0 logs ``comm/<dim>/<kind>_MB`` and
``comm/<dim>/<kind>_count`` to the Trainer's loggers (W&B in the main job). ``CommLedger.steps`` keeps every
step's table, and ``CommLedger.setup_table`` the collectives before the first step (the build, a checkpoint's load);
``CommLedger(per_step=False)`` keeps only the set-up's table and costs nothing per step.

Cost: reading the recorder copies its ring (up to ``flight_recorder`` entries) once per optimizer step, on the
host; nothing touches the device. Meant for runs that look at communication, not for every production step.

Torch 2.13's recorder leaves gloo's send/recv out: on gloo with pipeline parallel the ledger counts the pipeline's
``c10d`` send and recv ops itself, with a ``TorchDispatchMode`` around each training batch (a Python call per op
in the step: a CPU debugging aid; on NCCL the recorder has them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import lightning as L

from cuboid import compat
from cuboid.parallel import dim_groups
from cuboid.step import muon_groups

DTYPE_BYTES = {"Float": 4, "Double": 8, "BFloat16": 2, "Half": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
               "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}  # fmt: skip


def kind_of(profiling_name: str) -> str:
    """A backend's op name (``gloo:all_gather``, ``nccl:_reduce_scatter_base``, ...) -> one of all_gather,
    reduce_scatter, all_reduce, all_to_all, gather, scatter, send_recv, broadcast, other."""
    name = profiling_name.split(":")[-1].lower().replace("_", "")
    for key, kind in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
                      ("alltoall", "all_to_all"), ("gather", "gather"), ("scatter", "scatter"), ("send", "send_recv"),
                      ("recv", "send_recv"), ("broadcast", "broadcast")):  # fmt: skip
        if key in name:
            return kind
    return "other"


def entry_bytes(entry: dict[str, Any], kind: str, group_size: int) -> int:
    """Full-tensor bytes: an all-gather's, a gather's and a scatter's input times the group's size (one rank's
    piece; gloo records an all-gather's output as the input's shape), any other collective's input."""
    total = 0
    for size, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False):
        total += math.prod(size) * DTYPE_BYTES.get(dtype, 4)
    return total * group_size if kind in ("all_gather", "gather", "scatter") else total


def _mesh_groups(mesh: Any, experts: Any = None) -> dict[str, tuple[str, int]]:
    """Process-group name -> (mesh dimension, size), for this rank: the first dimension (pp, dp_replicate,
    dp_shard, cp, tp, then the flattened dp and dp_shard_cp, FSDP's under cp; then expert parallel's ep and efsdp,
    from its own mesh) of size > 1 that uses it (``experts``: the strategy's :attr:`experts_layout`). A dimension as large as the world shares the
    default group."""
    found: dict[str, tuple[str, int]] = {}
    dims = [*dim_groups(mesh, ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp"))]
    if experts is not None:
        dims += dim_groups(experts.fsdp_mesh, ("efsdp",))
        ep = experts.ep_mesh.get_group()  # may be another dimension's group too: its all-to-alls are expert parallel's
        found[f"{ep.group_name}/all_to_all"] = ("ep", ep.size())
    for dim, group in dims:
        if group.size() > 1:
            found.setdefault(group.group_name, (dim, group.size()))
    return found


def _tally(entries: list[dict[str, Any]], groups: dict[str, tuple[str, int]]) -> dict[str, dict[str, list[int]]]:
    """{dimension: {kind: [count, bytes]}} of the given flight-recorder entries (``groups``: :func:`_mesh_groups`;
    other groups go by their description: ``default_pg`` is "world", Cuboid's gloo group "cuboid_host")."""
    table: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for entry in entries:
        kind = kind_of(str(entry.get("profiling_name", "")))
        name, desc = entry["process_group"]
        other = ({"default_pg": "world"}.get(desc, desc or name), 1)
        dim, size = groups.get(f"{name}/{kind}") or groups.get(name, other)
        cell = table[dim][kind]
        cell[0] += 1
        cell[1] += entry_bytes(entry, kind, size)
    return {dim: dict(kinds) for dim, kinds in table.items()}


def newest_records(entries: list[dict[str, Any]]) -> dict[str, int]:
    """The newest record id of each recorder ring among ``entries`` (torch's generic recorder and NCCL's count their
    records apart)."""
    newest: dict[str, int] = {}
    for entry in entries:
        ring = entry.get("ring", "fr")
        newest[ring] = max(newest.get(ring, -1), entry["record_id"])
    return newest


def entries_after(entries: list[dict[str, Any]], cursors: dict[str, int]) -> list[dict[str, Any]]:
    """The entries newer than each ring's cursor (a ring without one: all of its entries)."""
    return [e for e in entries if e["record_id"] > cursors.get(e.get("ring", "fr"), -1)]


class CommLedger(L.Callback):
    """Records every optimizer step's collectives (see the module docstring). ``log``: send them to the loggers on
    logging steps (rank 0). ``per_step=False``: record only the set-up's collectives (``setup_table``), with no work
    in the steps (no recorder read, no dispatch mode under pp on gloo)."""

    def __init__(self, log: bool = True, per_step: bool = True) -> None:
        self.log = log
        self.per_step = per_step
        self.steps: list[dict[str, dict[str, list[int]]]] = []
        # Everything before the first step, in one table of the same shape: the build (the weights rank 0 sends,
        # under pp over groups named cuboid_weights_stage<s>), a checkpoint's load (as far as the recorder's ring
        # still holds it).
        self.setup_table: dict[str, dict[str, list[int]]] = {}
        self._setup_from: dict[str, int] = {}
        self._last: dict[str, int] = {}  # per recorder ring (generic, NCCL's): the newest record already counted
        self._groups: dict[str, tuple[str, int]] = {}
        self._p2p: Any = None  # on gloo with pp > 1 (see the module docstring)
        self._p2p_active = False
        self._experts: Any = None  # handed by CuboidStrategy at setup (attach): the experts' meshes under ep
        self._replica_groups: int | None = None  # and the fault-tolerant replica groups' number, if any

    def attach(self, experts: Any, replica_groups: int | None) -> None:
        """Handed by :class:`cuboid.CuboidStrategy` at setup, what the ledger reads of the run besides its mesh:
        the experts' layout under ``expert_parallel > 1`` (their ``ep`` and FSDP meshes; None otherwise) and the
        number of fault-tolerant replica groups (None without them). Under another strategy nothing is handed."""
        self._experts, self._replica_groups = experts, replica_groups

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Before the model is built: where the set-up's collectives start (an earlier fit's are not counted)."""
        self._setup_from = newest_records(compat.flight_recorder_entries())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        entries = compat.flight_recorder_entries()
        if not entries and trainer.world_size > 1:
            raise RuntimeError(
                "CommLedger reads torch's flight recorder, which is off: use CuboidStrategy(flight_recorder=N) with "
                "N > 0 (the default, 20000), and do not set TORCH_FR_BUFFER_SIZE=0."
            )
        self._last = newest_records(entries)
        mesh = getattr(pl_module, "device_mesh", None)  # the strategy's mesh (Lightning's ModelParallel's too)
        self._groups = _mesh_groups(mesh, self._experts) if mesh is not None else {}
        if self._replica_groups is not None:  # torchft's process group over the replica groups: unnamed there
            self._groups.setdefault("", ("replica_groups", self._replica_groups))
        self.setup_table = _tally(entries_after(entries, self._setup_from), self._groups)
        if self.per_step and mesh is not None and "pp" in (mesh.mesh_dim_names or ()) and mesh["pp"].size() > 1:
            import torch.distributed as dist

            if dist.get_backend(mesh["pp"].get_group()) == "gloo":
                self._p2p = compat.PointToPointCounter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._p2p is not None and not self._p2p_active:  # still active if the last batch end never came
            self._p2p.__enter__()
            self._p2p_active = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._exit_p2p()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._exit_p2p()

    def _exit_p2p(self) -> None:
        if self._p2p is not None and self._p2p_active:
            self._p2p.__exit__(None, None, None)
            self._p2p_active = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._exit_p2p()
        if not self.per_step or compat.should_accumulate(trainer):
            return
        entries = entries_after(compat.flight_recorder_entries(), self._last)
        self._last = {**self._last, **newest_records(entries)}
        step = _tally(entries, {**muon_groups(), **self._groups})  # (Muon's groups are made at its first step)
        if self._p2p is not None:  # gloo's send/recv, counted by the dispatch mode
            step.setdefault("pp", {})["send_recv"] = [self._p2p.count, self._p2p.bytes]
            self._p2p.count = self._p2p.bytes = 0
        self.steps.append(step)
        every = trainer.log_every_n_steps
        if self.log and trainer.is_global_zero and trainer.loggers and every and trainer.global_step % every == 0:
            metrics = {}
            for dim, kinds in step.items():
                for kind, (count, nbytes) in kinds.items():
                    metrics[f"comm/{dim}/{kind}_count"] = float(count)
                    metrics[f"comm/{dim}/{kind}_MB"] = nbytes / 1e6
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


def hand_to_ledgers(callbacks: Sequence[Any], experts: Any, replicas: Any) -> None:
    """Hand each :class:`CommLedger` among a Trainer's ``callbacks`` what it reads of the run (:meth:`CommLedger.attach`):
    the experts' layout and, with fault-tolerant ``replicas`` (:class:`cuboid.replicas.ReplicaGroups`), their number."""
    groups = replicas.config.groups if replicas is not None else None
    for callback in callbacks:
        if isinstance(callback, CommLedger):
            callback.attach(experts, groups)
