"""One run writes checkpoints into a directory at a time.

Two jobs given the same directory (a sweep whose jobs share ``hydra.run.dir``, the same command started twice, two
SLURM jobs with one run id) would overwrite each other's ``step=N.ckpt`` and ``last.ckpt``, prune each other's
top-k, and a later ``ckpt_path="auto"`` would resume one from the other's weights. At the start of ``fit``, rank 0
creates ``<checkpoint dir>/.cuboid-run.lock`` (atomically, ``O_EXCL``) naming its host, process, job and start
time, refreshes its time stamp every 30 s from a daemon thread, and deletes it at the end of the run. A second run
that finds a live lock stops before any work, on every rank, with :class:`RunDirectoryBusy` naming the holder.

A lock is taken over, with a log line, when its holder is gone: the same SLURM job (a requeue) or TorchElastic run
id, a process of this host that no longer exists, or a time stamp not refreshed for ``stale_after`` seconds (a
holder on another host that was killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from cuboid.job.launch import slurm_job_id
from cuboid.storage import RemotePath, to_path

LOCK_NAME = ".cuboid-run.lock"


class RunDirectoryBusy(RuntimeError):
    """Another live run writes checkpoints into the same directory."""


def job_id() -> str | None:
    """This job's identity across restarts: SLURM's job id (array-aware), else TorchElastic's run id."""
    slurm = slurm_job_id()
    if slurm:
        return f"slurm:{slurm}"
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchelastic:{run}" if run and run != "none" else None


class RunLock:
    def __init__(
        self, directory: str | Path, stale_after: float = 120.0, refresh: float = 30.0, run: str | None = None
    ) -> None:
        """``run``: a run several jobs make together (fault-tolerant replica groups: their lighthouse); a job of the
        same run finds the directory shared, not busy."""
        self.path = to_path(directory) / LOCK_NAME  # a local directory, or a URL fsspec reaches (s3://...)
        self.stale_after, self.refresh = stale_after, refresh
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "started": time.time()}
        if run is not None:
            self.me["run"] = run
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirectoryBusy` naming the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._create()
        except FileExistsError:
            holder, age = self._read()
            if holder and self.me.get("run") and holder.get("run") == self.me["run"] and age <= self.stale_after:
                return  # another job of the same run holds it: shared, and refreshed by that job
            why = self._gone(holder, age)
            if why is None:
                raise RunDirectoryBusy(self._busy_message(holder, age)) from None
            rank_zero_info(f"Cuboid: taking over {self.path} ({why})")
            self._overwrite()
            if self._read()[0] != self.me:  # another run took it over in the same instant
                holder, age = self._read()
                raise RunDirectoryBusy(self._busy_message(holder, age)) from None
        self.held = True
        self._thread = threading.Thread(target=self._keep_fresh, name="cuboid-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.held:
            self.held = False
            if self._read()[0] == self.me:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()

    def _create(self) -> None:
        """The lock file made only if none is there (``O_EXCL``; on object storage a conditional PUT, "xb"),
        holding this run; raises FileExistsError otherwise."""
        if isinstance(self.path, RemotePath):
            with self.path.open("xb") as f:
                f.write(json.dumps(self.me).encode())
            return
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.me))

    def _overwrite(self) -> None:
        """Replace a lock whose holder is gone by this run's, whole (a rename locally, one PUT remotely)."""
        if isinstance(self.path, RemotePath):
            self.path.write_text(json.dumps(self.me))
            return
        tmp = self.path.with_name(f"{LOCK_NAME}.{self.me['host']}.{self.me['pid']}")
        tmp.write_text(json.dumps(self.me))
        os.replace(tmp, self.path)

    def _keep_fresh(self) -> None:
        while not self._stop.wait(self.refresh):
            with contextlib.suppress(OSError):
                if isinstance(self.path, RemotePath):  # its time stamp is the object's: written again
                    self._overwrite()
                else:
                    os.utime(self.path)

    def _read(self) -> tuple[dict[str, Any] | None, float]:
        try:
            age = time.time() - self.path.stat().st_mtime
            return json.loads(self.path.read_text()), age
        except FileNotFoundError:
            return None, float("inf")
        except (OSError, ValueError):  # half-written by a holder being created right now
            return {}, 0.0

    def _gone(self, holder: dict[str, Any] | None, age: float) -> str | None:
        """Why the holder no longer holds it, or None while it may."""
        if holder is None:
            return "its holder just released it"
        if holder.get("host") == self.me["host"] and holder.get("pid") == self.me["pid"]:
            return "an earlier run of this process left it"
        if holder.get("job") and holder.get("job") == self.me["job"]:
            return f"the same job {holder['job']}, restarted"
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            try:
                os.kill(holder["pid"], 0)
            except ProcessLookupError:
                return f"its process {holder['pid']} on this host has exited"
            except PermissionError:
                pass
        if age > self.stale_after:
            return f"not refreshed for {age:.0f} s"
        return None

    def _busy_message(self, holder: dict[str, Any] | None, age: float) -> str:
        who = "a run being set up right now"
        if holder:
            job = f", job {holder['job']}" if holder.get("job") else ""
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
            who = f"host {holder.get('host')}, pid {holder.get('pid')}{job}, started {since}"
        return (
            f"{self.path.parent} is in use by another run ({who}; its lock was refreshed {age:.0f} s ago). Two runs "
            "writing checkpoints into one directory would overwrite each other's, and a resume would mix them. Give "
            "this run its own directory (hydra.run.dir=..., Trainer(default_root_dir=...) or "
            f"ModelCheckpoint(dirpath=...)) or stop the other run. If that run is gone, delete {self.path} (a lock "
            f"not refreshed for {self.stale_after:g} s is taken over by itself)."
        )
