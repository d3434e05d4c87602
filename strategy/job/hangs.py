"""A collective that never completes: every rank's timeout is the one the user set, the error names the collective,
the mesh dimension and the ranks of it that never joined, and every rank of the job stops.

Three parts:

* **Timeouts.** ``DeviceMesh`` makes its per-dimension process groups with torch's default timeout (30 min on
  gloo, 10 min on NCCL) whatever ``init_process_group`` was given; :func:`apply_timeout` sets the strategy's
  ``timeout`` on each of them.
* **Flight recorder.** Before the process group exists, :func:`flight_recorder_env` turns on torch's flight
  recorder (a ring of the last ``entries`` collectives per process, gloo and NCCL alike) and, on NCCL, its dump on
  timeout, to ``<dump_dir>/rank_<r>`` (a user's own ``TORCH_*`` settings win). On NCCL, torch's analyzer
  ``torchfrtrace <dump_dir> -p rank_`` names the first collective the ranks disagree on (torch 2.13's gloo dumps
  lack the group table it needs; the message below does that analysis for gloo). Cuboid's own dump, written with
  the message, is ``<dump_dir>/cuboid_rank_<r>``: beside NCCL's, never over it.
* **The message** (gloo, and NCCL with ``TORCH_NCCL_BLOCKING_WAIT``, where the timeout reaches Python as an
  exception): :class:`HangReport` posts this rank's status (the last sequence number it issued on each group, from
  its flight recorder) in the rendezvous store and marks the job there; every other rank's peer watchdog thread
  answers the mark with its own status and the frame its main thread is in, then stops its rank (exit code 3): the
  stuck one too, instead of each rank waiting out its own timeout. From the statuses the report finds the first
  collective of this rank's that a member of its group never issued, and names it (kind, mesh dimension, ranks,
  sequence number), the members that never joined and where they were; it writes the dump beside the run.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cuboid import compat
from cuboid.job.watchdog import mark_job
from cuboid.parallel import dim_groups

_DUMP_PREFIX = "cuboid_rank_"  # Cuboid's dump, beside torch's own
_NCCL_DUMP_PREFIX = "cuboid_nccl_rank_"  # Cuboid's dump of NCCL's own recorder (CUDA builds, NCCL groups)
_TORCH_DUMP_PREFIX = "rank_"  # torch's dumps (TORCH_FR_DUMP_TEMP_FILE, NCCL's on a timeout)
_TIMEOUT_WORDS = ("Timed out", "timed out", "Watchdog caught collective operation timeout", "DistTimeoutError")


def flight_recorder_env(dump_dir: Path, entries: int, backend: str) -> None:
    """Turn torch's flight recorder on for this process (``entries`` > 0), before its process group is made."""
    if entries <= 0:
        return
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(dump_dir / _TORCH_DUMP_PREFIX))
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(entries))
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(dump_dir / _TORCH_DUMP_PREFIX))
        dump_dir.mkdir(parents=True, exist_ok=True)  # NCCL's watchdog writes there without creating it


def known_groups(mesh: Any, names: list[str], others: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """Process-group name -> (what it is, the group) for this rank: each mesh dimension, by the first of ``names``
    that answers with its group (a flattened view over one dimension's ranks shares that dimension's group and
    name), and ``others`` (label -> group: Cuboid's host group, the world)."""
    found: dict[str, tuple[str, Any]] = {}
    for name, group in dim_groups(mesh, names):
        found.setdefault(group.group_name, (f"mesh dimension {name!r}", group))
    for label, group in others.items():
        if group is not None and group.group_name not in found:
            found[group.group_name] = (label, group)
    return found


def apply_timeout(groups: list[Any], timeout: timedelta) -> None:
    """Set the strategy's collective timeout on each group (a mesh dimension's, a helper group of Cuboid's)."""
    for group in groups:
        compat.set_group_timeout(group, timeout)


def is_timeout(exception: BaseException) -> bool:
    text = f"{type(exception).__name__}: {exception}"
    return isinstance(exception, getattr(dist, "DistTimeoutError", ())) or any(w in text for w in _TIMEOUT_WORDS)


MARK = "a collective timed out"  # the start of the job's mark (cuboid.job.watchdog.mark_job) when a hang is reported
_STATUS, _DONE = "cuboid/hang/status/", "cuboid/hang/done/"


def status(reporter: bool) -> dict[str, Any]:
    """What this rank was doing: the last sequence number it issued on each process group (from its flight
    recorder) and, when posted by the watchdog's thread, where the main thread is (the innermost frame outside
    torch, Lightning and the standard library)."""
    last: dict[str, int] = {}
    for entry in compat.flight_recorder_entries():
        key, seq = _key_and_seq(entry)
        last[key] = max(last.get(key, 0), seq)
    return {"last": last, "where": None if reporter else _main_thread_frame(), "reporter": reporter}


def _main_thread_frame() -> str | None:
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001  (documented in sys)
    frameworks = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")
    skip = (*(os.sep + name + os.sep for name in frameworks), os.path.dirname(threading.__file__) + os.sep)
    for summary in reversed(traceback.extract_stack(frame) if frame is not None else []):
        if not any(part in summary.filename or summary.filename.startswith(part) for part in skip):
            return f"{summary.filename}:{summary.lineno} in {summary.name} ({(summary.line or '').strip()})"
    return None


def respond(store: Any, rank: int, mark: str, dump_dir: Path | None, wait: float = 5.0) -> None:
    """The watchdog's answer to a hang mark (on its own thread): post this rank's status, print where it is, write
    its flight recorder, and on rank 0 (the store's host) stay until the reporters have read the statuses."""
    if not mark.startswith(MARK):
        return
    try:
        store.set(f"{_STATUS}{rank}", json.dumps(status(reporter=False)))
        _write_dump(dump_dir, rank)
        print(f"Cuboid (rank {rank}): {mark}; this rank was at {_main_thread_frame()}", file=sys.stderr, flush=True)
        if rank == 0:
            _linger(store, dist.get_world_size(), wait)
    except Exception:  # noqa: BLE001  (the store may be gone: exit anyway)
        pass


class HangReport:
    """Names a timed-out collective (see the module docstring). ``groups`` is :func:`known_groups`'s answer;
    ``store`` is the rendezvous store (None: no cross-rank part)."""

    def __init__(
        self, rank: int, groups: dict[str, tuple[str, Any]], store: Any, dump_dir: Path | None, timeout: timedelta
    ) -> None:
        self.rank, self.groups, self.store, self.dump_dir, self.timeout = rank, groups, store, dump_dir, timeout

    def describe(self, wait: float = 5.0) -> str:
        """Post this rank's status, mark the job (every rank's watchdog posts its own and stops its rank), read the
        others' for up to ``wait`` seconds, and say which collective this rank waited in and who never joined it."""
        entries = compat.flight_recorder_entries()
        secs = f"{self.timeout.total_seconds():g} s"
        if not entries:
            self._mark()
            return (
                f"rank {self.rank}: a collective did not complete within the timeout ({secs}); the flight recorder is "
                "off (CuboidStrategy(flight_recorder=0) or TORCH_FR_BUFFER_SIZE=0), so which one is unknown. Every "
                "rank of the job is being stopped; resume from the last checkpoint."
            )
        statuses = self._exchange(wait)
        stuck, missing = self._stuck(entries, statuses)
        name, desc = stuck["process_group"]
        kind = str(stuck.get("profiling_name", "?")).split(":")[-1]
        where, group = self.groups.get(name, (f"process group {name} ({desc or 'unnamed'})", None))
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        _, seq = _key_and_seq(stuck)
        lines = [
            f"rank {self.rank}: {kind} over {where} (ranks {ranks}, #{seq} on that group, input sizes "
            f"{stuck.get('input_sizes')}) did not complete within {secs}."
        ]
        for m, (last, at) in missing.items():
            place = f"; it was at {at}" if at else " (it was waiting in another collective that timed out)"
            lines.append(f"Rank {m} never joined it (its last on that group: #{last}){place}.")
        if not missing:
            lines.append("No rank's flight recorder shows which rank is missing (a rank that exited?).")
        dumped = _write_dump(self.dump_dir, self.rank)
        if dumped is not None:
            lines.append(f"Each rank's flight recorder: {dumped.parent}/{_DUMP_PREFIX}<r>.")
            if dist.get_backend() == "nccl":
                lines.append(f"NCCL's own recorder: {dumped.parent}/{_NCCL_DUMP_PREFIX}<r> (torchfrtrace "
                             f"{dumped.parent} -p {_NCCL_DUMP_PREFIX} compares them), and as torch's watchdog wrote "
                             f"it: {dumped.parent}/{_TORCH_DUMP_PREFIX}<r>.")  # fmt: skip
        lines.append("Every rank of the job is being stopped; resume from the last checkpoint.")
        if self.store is not None:
            self.store.set(f"{_DONE}{self.rank}", "1")
            if self.rank == 0:
                _linger(self.store, dist.get_world_size(), wait)
        return " ".join(lines)

    def _mark(self) -> None:
        if self.store is not None:
            mark_job(self.store, f"{MARK} (first reported by rank {self.rank})")

    def _exchange(self, wait: float) -> dict[int, dict[str, Any]]:
        if self.store is None:
            return {}
        try:
            self.store.set(f"{_STATUS}{self.rank}", json.dumps(status(reporter=True)))
            self._mark()
            world = dist.get_world_size()
            deadline = time.monotonic() + wait
            while True:
                posted = {r: _get(self.store, f"{_STATUS}{r}") for r in range(world)}
                if all(v is not None for v in posted.values()) or time.monotonic() > deadline:
                    return {r: json.loads(v) for r, v in posted.items() if v is not None}
                time.sleep(0.2)
        except Exception:  # noqa: BLE001
            return {}

    def _stuck(self, entries: list[dict], statuses: dict[int, dict]) -> tuple[dict, dict[int, tuple[int, Any]]]:
        """The first collective of this rank's that a member of its group never issued, and those members
        (rank -> (its last sequence number there, where it was)); else the newest entry and nobody."""
        for entry in entries:
            name = entry["process_group"][0]
            if name not in self.groups:
                continue
            key, seq = _key_and_seq(entry)
            missing = {}
            for m in dist.get_process_group_ranks(self.groups[name][1]):
                other = statuses.get(m)
                if m != self.rank and other is not None and other["last"].get(key, 0) < seq:
                    missing[m] = (other["last"].get(key, 0), other["where"])
            if missing:
                return entry, missing
        return entries[-1], {}


def _write_dump(dump_dir: Path | None, rank: int) -> Path | None:
    """This rank's flight recorder, pickled as torch dumps it, to ``<dump_dir>/cuboid_rank_<rank>``, and NCCL's own
    recorder, where this process has NCCL entries, to ``cuboid_nccl_rank_<rank>`` (torch's own dumps, NCCL's on a
    timeout among them, take ``rank_<rank>`` in the same folder)."""
    if dump_dir is None:
        return None
    try:
        dump_dir.mkdir(parents=True, exist_ok=True)
        path = dump_dir / f"{_DUMP_PREFIX}{rank}"
        path.write_bytes(compat.flight_recorder_dump("fr") or b"")
        nccl = compat.flight_recorder_dump("nccl")  # NCCL's own recorder (CUDA builds), beside the generic one
        if nccl is not None and pickle.loads(nccl).get("entries"):
            (dump_dir / f"{_NCCL_DUMP_PREFIX}{rank}").write_bytes(nccl)
        return path
    except Exception as err:  # noqa: BLE001  (a report must not fail on a full disk)
        print(f"Cuboid (rank {rank}): could not write the flight recorder dump: {err}", file=sys.stderr)
        return None


def _key_and_seq(entry: dict[str, Any]) -> tuple[str, int]:
    name = entry["process_group"][0]
    if entry.get("is_p2p"):
        return f"{name}/p2p", int(entry.get("p2p_seq_id") or 0)
    return name, int(entry.get("collective_seq_id") or 0)


def _get(store: Any, key: str) -> str | None:
    """A store key's value, or None while no rank has set it."""
    return store.get(key).decode() if store.check([key]) else None


def _linger(store: Any, world: int, wait: float) -> None:
    """Rank 0 hosts the store: keep it up until every rank posted its status and every reporter is done."""
    deadline = time.monotonic() + wait + 1
    while time.monotonic() < deadline:
        try:
            statuses = [_get(store, f"{_STATUS}{r}") for r in range(world)]
            reporters = [r for r, v in enumerate(statuses) if v is not None and json.loads(v)["reporter"]]
            if all(v is not None for v in statuses) and all(store.check([f"{_DONE}{r}"]) for r in reporters):
                return
        except Exception:  # noqa: BLE001
            return
        time.sleep(0.2)
