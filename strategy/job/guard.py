"""What the strategy does about a job's faults, in one place: the peer watchdog (a dead rank), the per-step stop
agreement (signals, preemption, a failed background save), even batch counts, the same batch on a data-parallel
rank's peers, collective timeouts and the flight recorder (a hang), and one run per checkpoint directory.
:class:`CuboidStrategy` calls these hooks from its own; each part lives in its own module (``watchdog``,
``stopping``, ``even_batches``, ``peer_batches``, ``hangs``, ``run_lock``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cuboid import compat
from cuboid.job import hangs, stopping
from cuboid.job.even_batches import EvenBatches
from cuboid.job.peer_batches import PeerBatches
from cuboid.job.run_lock import RunDirectoryBusy, RunLock
from cuboid.job.watchdog import PeerWatchdog
from cuboid.step import TpGradients


class JobGuard:
    def __init__(
        self,
        preempt_on: Sequence[str],
        peer_timeout: float,
        timeout: timedelta,
        flight_recorder: int,
        shared_run: str | None = None,
    ) -> None:
        self.preempt_on = stopping.signal_numbers(preempt_on)
        self.peer_timeout, self.timeout = peer_timeout, timeout
        if flight_recorder < 0:
            raise ValueError(f"flight_recorder={flight_recorder}: a number of entries >= 0 (0 turns it off).")
        self.flight_recorder = flight_recorder
        self.dump_dir: Path | None = None
        self.shared_run = shared_run  # fault-tolerant replica groups share checkpoint directories (RunLock)
        self.host_group: Any = None  # a gloo group of every rank (made at setup): per-step host-only agreement
        self.mesh: Any = None  # the strategy's device mesh, handed to after_mesh
        self.watchdog: PeerWatchdog | None = None
        self.stop: stopping.StopAgreement | None = None
        self.even: EvenBatches | None = None
        self.peers: PeerBatches | None = None
        self.tp_gradients: TpGradients | None = None
        self.hang: hangs.HangReport | None = None
        self.locks: list[RunLock] = []  # rank 0: the checkpoint directories this fit writes to
        self.preempted_to: Path | None = None  # the checkpoint a preemption signal made the last fit save

    def __getstate__(self) -> dict[str, Any]:
        """What it was asked to do, pickled; what belongs to the running processes (process groups, the mesh, the
        store, the watchdog's thread, the installed per-step checks, the directory locks) left out."""
        state = dict(vars(self))
        state.update(host_group=None, mesh=None, watchdog=None, stop=None, even=None, peers=None, tp_gradients=None,
                     hang=None, locks=[])  # fmt: skip
        return state

    # --- setup_environment
    def before_process_group(self, root_dir: str | Path, backend: str) -> None:
        if self.flight_recorder > 0:
            self.dump_dir = Path(root_dir) / "flight_recorder"
            hangs.flight_recorder_env(self.dump_dir, self.flight_recorder, backend)

    def after_process_group(self, rank: int, world_size: int) -> None:
        if self.peer_timeout > 0 and self.watchdog is None:
            self.watchdog = PeerWatchdog(compat.default_store(), rank, world_size, self.peer_timeout)
            self.watchdog.start()

    def after_mesh(self, mesh: Any, names: Sequence[str], rank: int) -> None:
        self.mesh = mesh
        if self.host_group is None:
            self.host_group = stopping.host_group()
        groups = hangs.known_groups(
            mesh,
            list(names),
            {"every rank (Cuboid's per-step agreement)": self.host_group, "the world": dist.group.WORLD},
        )
        hangs.apply_timeout([group for _, group in groups.values()], self.timeout)
        store = compat.default_store() if dist.get_world_size() > 1 else None
        self.hang = hangs.HangReport(rank, groups, store, self.dump_dir, self.timeout)
        if self.watchdog is not None and store is not None:
            self.watchdog.on_mark = lambda mark: hangs.respond(store, rank, mark, self.dump_dir)

    # --- setup
    def setup(
        self, trainer: Any, fitting: bool, saves: stopping.BackgroundSaves, dealt: Mapping[str, int], data_ranks: int
    ) -> None:
        """The strategy's setup: ``saves``, its checkpointer; ``dealt``, Lightning's sampler split (``rank``,
        ``num_replicas``: the data-parallel ranks, whose peers share a rank); ``data_ranks``, the dp degree."""
        self.even = EvenBatches(trainer, self.host_group)
        self.even.install()
        self.peers = PeerBatches(trainer, self.host_group, dealt["rank"], data_ranks, dealt["num_replicas"])
        self.peers.install()
        if fitting:
            tp = self.mesh["tp"]
            if tp.size() > 1:  # whole parameters get the same gradient on every tp rank (cuboid.step.tp_gradients)
                self.tp_gradients = TpGradients(trainer, tp.get_group())
                self.tp_gradients.install()
            self._lock_checkpoint_dirs(trainer)
            self.stop = stopping.StopAgreement(trainer, self.host_group, self.preempt_on, saves)
            self.stop.install()

    def _lock_checkpoint_dirs(self, trainer: Any) -> None:
        """Rank 0 locks each ModelCheckpoint's directory (cuboid.job.run_lock); every rank stops if one is busy."""
        dirs = sorted({str(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)})
        problem = None
        if trainer.is_global_zero:
            for directory in dirs:
                lock = RunLock(directory, run=self.shared_run)
                try:
                    lock.acquire()
                except RunDirectoryBusy as err:
                    problem = str(err)
                    break
                self.locks.append(lock)
        if dist.get_world_size() > 1:  # once per fit, over gloo
            box = [problem]
            dist.broadcast_object_list(box, src=0, group=self.host_group)
            problem = box[0]
        if problem is not None:
            self._release_locks()
            raise RunDirectoryBusy(problem)

    def _release_locks(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []

    def extra_group(self, group: Any) -> None:
        """A group Cuboid made after the mesh (the checkpointer's): the same timeout."""
        if group is not None:
            hangs.apply_timeout([group], self.timeout)

    # --- on_exception
    def on_exception(self, exception: BaseException) -> None:
        """A timed-out collective: name it and stop every rank. Another failed collective (a closed connection, an
        NCCL error): give the watchdog its few seconds to name a dead rank (it exits the process, code 3)."""
        if hangs.is_timeout(exception) and self.hang is not None:
            if self.watchdog is not None:  # this rank reports; its own watchdog must not exit it meanwhile
                self.watchdog.stop()
                self.watchdog = None
            message = self.hang.describe()
            print(f"Cuboid: {message}", file=sys.stderr, flush=True)
            if hasattr(exception, "add_note"):
                exception.add_note(f"Cuboid: {message}")
            return
        text = str(exception)
        communication = isinstance(exception, dist.DistError) or any(
            word in text for word in ("Connection closed", "Connection reset", "gloo", "NCCL")
        )
        if communication and self.watchdog is not None:
            self.watchdog.verdict()

    # --- teardown
    def teardown(self) -> None:
        if self.watchdog is not None:  # first: a peer that finishes earlier must not look dead
            self.watchdog.stop()
            self.watchdog = None

    def after_teardown(self) -> None:
        self._release_locks()
        if self.even is not None:
            self.even.uninstall()
            self.even = None
        if self.peers is not None:
            self.peers.uninstall()
            self.peers = None
        if self.tp_gradients is not None:
            self.tp_gradients.uninstall()
            self.tp_gradients = None
        if self.stop is not None:
            self.stop.uninstall()
            self.preempted_to = self.stop.preempted_to or self.preempted_to
            self.stop = None
