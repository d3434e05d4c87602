"""Stopping together: a signal to any rank stops every rank after the same optimizer step, through host memory only;
on a preemption signal every rank first saves one checkpoint, and the job asks SLURM to requeue it.

Lightning 2.6's training loop asks at the start of every step whether rank 0 received SIGTERM
(``_TrainingEpochLoop._broadcast_sigterm_tensor``): a tensor made on the device, broadcast over the default group
(NCCL on GPUs) and read back with ``.item()``, a host sync per step that stalls the launch queue. Its SIGTERM
handler broadcasts from inside the handler (pairing with whatever collective the other ranks are in), its loops
then stop the signalled rank alone at the end of its step, and under SLURM auto-requeue its SIGUSR1 handler calls
``trainer.save_checkpoint`` from inside the handler, at a different point on each rank (a collective save that
mismatches and hangs). Cuboid drops all three: the handlers only record the signal, and after each optimizer step
a MAX all-reduce of one host integer over a gloo group tells every rank what any rank received. That all-reduce is
sent without waiting and read one optimizer step later (by then it has long completed), so no step waits on it: a
request received during step N is acted on, by every rank at once, at the end of step N + 1:

* a signal in ``preempt_on`` (default SIGUSR1, which ``sbatch --signal=USR1@120`` sends before the time limit,
  and SIGTERM, which SLURM sends on preemption or ``scancel``): every rank saves
  ``<checkpoint dir>/preempted-step=<N>.ckpt`` (the ModelCheckpoint's ``dirpath``, else
  ``<default_root_dir>/checkpoints``), waits for it to be complete, then rank 0 asks SLURM to requeue the job
  (``requeue`` below: through the batch script when it says so, else ``scontrol requeue``); every rank stops with ``SIGTERMException`` (exit code 0), raised by
  Lightning's loop at the end of the step once its metrics are logged. The next start with
  ``ckpt_path="auto"`` resumes from it.
* SIGTERM not in ``preempt_on``: every rank stops the same way without saving (Lightning's behaviour, agreed).
* a background (async) checkpoint save that failed on some rank (a full disk): every rank raises its
  ``CheckpointError`` at the same step, instead of the error waiting in a thread until the next save.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from cuboid import compat
from cuboid.checkpoint import CheckpointError
from cuboid.job.launch import slurm_job_id
from cuboid.storage import to_path

STOP, PREEMPT, SAVE_FAILED = 1, 2, 3


def host_group() -> Any:
    """A gloo group of every rank: the default group when it is gloo, else a new one (made by every rank)."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", group_desc="cuboid_host")


def signal_numbers(names: Sequence[str | int]) -> tuple[signal.Signals, ...]:
    """``("SIGUSR1", "SIGTERM")`` -> signal numbers; a clear error for a name that is not a signal."""
    out = []
    for name in names:
        try:
            out.append(signal.Signals[name] if isinstance(name, str) else signal.Signals(name))
        except (KeyError, ValueError):
            raise ValueError(
                f"preempt_on={list(names)!r}: {name!r} is not a signal; use names such as 'SIGUSR1', 'SIGTERM'."
            ) from None
    return tuple(out)


class BackgroundSaves(Protocol):
    """What the stop agreement uses of the strategy's checkpointer (:class:`cuboid.checkpoint.Checkpointer`)."""

    def failure(self) -> BaseException | None:
        """A background save that failed (None while it runs or when it succeeded), without waiting."""
        ...

    def settle(self) -> None:
        """Wait for a background save to finish, keeping its outcome for :meth:`failure`."""
        ...

    def wait(self) -> None:
        """Wait until a background save is on disk, raising its error if it failed."""
        ...


class StopAgreement(L.Callback):
    """Added to the Trainer's callbacks by the strategy at setup (fit only); see the module docstring. ``saves``:
    the strategy's checkpointer, handed in: its background save's failure, checked at every step, and waited for
    at the end of training and after a preemption's save."""

    def __init__(self, trainer: Any, group: Any, preempt_on: Sequence[signal.Signals], saves: BackgroundSaves) -> None:
        self.trainer, self.group, self.preempt_on = trainer, group, tuple(preempt_on)
        self.save_failure = saves.failure  # a background save that failed, surfaced at the next step on every rank
        self.settle_saves = saves.settle  # wait for a background save to finish (at the end of training)
        self.wait_for_save = saves.wait  # a preemption's save on disk before the process exits
        self.received = 0  # the strongest request this rank's handlers recorded (STOP or PREEMPT)
        self.preempted_to: Path | None = None
        self._in_flight: tuple[Any, torch.Tensor] | None = None  # the last step's all-reduce and its flag
        self._mark_received: Callable[[], None] = lambda: None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        compat.drop_sigterm_broadcast(self.trainer)
        self._mark_received = compat.take_over_sigterm(self.trainer, lambda: self._on_signal(signal.SIGTERM))
        compat.take_over_slurm_requeue_signal(self.trainer, lambda: self._on_signal(signal.SIGUSR1))
        ours = [sig for sig in self.preempt_on if sig != signal.SIGTERM]  # ours, whether or not Lightning has one
        if ours and threading.current_thread() is not threading.main_thread():
            # Python lets only the main thread install handlers (Ray Train runs the loop in a worker thread, so do a
            # notebook's background thread and a service): train on, with the signals left to whoever owns them.
            # Lightning does the same for SIGTERM (its _SignalConnector registers only on the main thread).
            rank_zero_info(f"Cuboid: fit runs off the main thread, where no signal handler can be installed: "
                           f"{', '.join(s.name for s in ours)} will not save a checkpoint before stopping (the "
                           f"engine that started this thread handles its own signals)")  # fmt: skip
            ours = []
        for sig in ours:
            self._previous[sig] = signal.signal(sig, lambda signum, frame: self._on_signal(signal.Signals(signum)))
        self.trainer.callbacks.append(self)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        compat.give_back_signals(self.trainer)
        if self in self.trainer.callbacks:
            self.trainer.callbacks.remove(self)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.received = max(self.received, PREEMPT if sig in self.preempt_on else STOP)

    def _send(self) -> tuple[Any, torch.Tensor]:
        flag = torch.tensor([SAVE_FAILED if self.save_failure() else self.received], dtype=torch.int64, device="cpu")
        return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag

    def _read(self, sent: tuple[Any, torch.Tensor] | None) -> int:
        if sent is None:
            return 0
        sent[0].wait()  # sent a step ago: complete by now, unless a rank is still behind
        return int(sent[1].tolist()[0])  # host memory

    def agreed_last_step(self) -> int:
        """What any rank had received (or SAVE_FAILED when a rank's background save had failed) by the end of the
        previous optimizer step; this step's own flags are sent for the next call. A collective: every rank calls it
        after each optimizer step, and every rank reads the same value."""
        sent, self._in_flight = self._in_flight, self._send()
        return self._read(sent)

    def agreed(self) -> int:
        """The strongest request any rank received up to now, waiting for it (the end of training)."""
        sent, self._in_flight = self._in_flight, None
        return max(self._read(sent), self._read(self._send()))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if compat.should_accumulate(trainer):  # only after an optimizer step: a checkpoint here resumes exactly
            return
        request = self.agreed_last_step()
        if request == SAVE_FAILED:
            self._raise_save_failure()
        if request == PREEMPT:
            self.preempted_to = self.save(trainer)
            requeue(trainer.is_global_zero)
        if request:
            # trainer.received_sigterm, on every rank at once: Lightning's loop raises SIGTERMException at the end of
            # this step, after logging it (raising here lost the step's logged metrics: a gap in the W&B curve).
            self._mark_received()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A background save still running after the last step: wait for it, and fail on every rank if it failed on
        any (a failure that finished after the last step's check would otherwise only be logged at teardown)."""
        self.settle_saves()
        if self.agreed() == SAVE_FAILED:
            self._raise_save_failure()

    def _raise_save_failure(self) -> None:
        raise self.save_failure() or CheckpointError(
            "a background checkpoint save failed on another rank (its log says why). Nothing was replaced: "
            "the previous checkpoints are intact; resume from the newest complete one."
        )

    def save(self, trainer: L.Trainer) -> Path:
        callback = trainer.checkpoint_callback
        dirpath = getattr(callback, "dirpath", None) or f"{str(trainer.default_root_dir).rstrip('/')}/checkpoints"
        path = to_path(str(dirpath)) / f"preempted-step={trainer.global_step}.ckpt"  # local, or a URL
        trainer.save_checkpoint(str(path))
        self.wait_for_save()  # an async save must be on disk before the process exits
        rank_zero_info(f"Cuboid: preempted after step {trainer.global_step}; checkpoint saved to {path}")
        return path


REQUEUE_FILE = "CUBOID_REQUEUE_FILE"


def requeue(is_rank0: bool) -> bool:
    """On rank 0 under SLURM, ask for this job (array task included) to be requeued. Returns whether it was asked.

    With ``$CUBOID_REQUEUE_FILE`` set (``scripts/slurm/train.sbatch`` sets it), rank 0 writes the job id there and
    the batch script runs ``scontrol requeue`` once ``srun`` has returned, every task having exited 0: a requeue
    asked from inside the step kills the tasks still shutting down (a ``ConnectionResetError`` traceback and
    ``srun: error: ... task 1: Terminated`` in the job's log). Otherwise rank 0 runs ``$CUBOID_SCONTROL requeue``
    (a site's wrapper, or a test's own recorder, so that a test simulating SLURM never reaches a real controller),
    else ``scontrol`` on the ``PATH``, as Lightning does."""
    job = slurm_job_id()
    if not is_rank0:
        return False
    flag = os.environ.get(REQUEUE_FILE)
    if job and flag:
        Path(flag).parent.mkdir(parents=True, exist_ok=True)
        Path(flag).write_text(f"{job}\n")
        rank_zero_info(
            f"Cuboid: requeue of job {job} asked through {flag}; the batch script requeues once every task has exited."
        )
        return True
    command = os.environ.get("CUBOID_SCONTROL", "scontrol")
    if not job or shutil.which(command) is None:
        rank_zero_info(f"Cuboid: not under SLURM with {command}: start the same command again to resume.")
        return False
    code = subprocess.call([command, "requeue", job])
    rank_zero_info(f"Cuboid: {command} requeue {job} -> exit code {code}")
    return code == 0
