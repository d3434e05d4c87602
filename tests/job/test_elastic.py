"""torchrun elastic: a killed worker costs the steps since the last checkpoint, nothing more.

Two torchrun agents on one machine (``--nnodes 1:2 --nproc-per-node 1 --max-restarts 1``, c10d rendezvous on
127.0.0.1), the main job on them with its default ``ckpt_path=auto`` and a run directory that stays the same across
restarts; one worker is SIGKILLed once the step-8 checkpoint is on disk. The agents restart the group, the job
resumes from that checkpoint at the next sample, continues the same W&B run, and both agents end with exit code 0.
Before ``cuboid.job.elastic`` both agents exited 1 within 19 s: the restarted workers read the dead round's gloo
addresses from the store torchrun's agent shares across rounds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness import ROOT, free_port, run_checked, worker_env
from wandb_records import history, read_records

from cuboid import latest_checkpoint

TRAIN = str(ROOT / "scripts" / "train.py")
JOB = ["data.max_bytes=300000", "data.seq_len=64", "data.batch_size=4", "trainer.num_nodes=2", "trainer.devices=1",
       "trainer.max_steps=16", "trainer.val_check_interval=4", "trainer.log_every_n_steps=1"]  # fmt: skip


def _agents(tmp: Path, port: int) -> list[subprocess.Popen]:
    env = worker_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=elastic{port}",
           "--monitor-interval=1", TRAIN, f"data.cache_dir={tmp / 'cache'}", *JOB, f"hydra.run.dir={tmp / 'run'}"]  # fmt: skip
    return [
        subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for log in (open(tmp / f"agent{n}.log", "w") for n in range(2))  # noqa: SIM115  (closed with the process)
    ]


def _uninterrupted(tmp: Path) -> Path:
    """The same job on one node's two processes (Lightning's launcher), uninterrupted: its run directory."""
    out = tmp / "reference"
    run_checked([sys.executable, TRAIN, f"data.cache_dir={tmp / 'cache'}", *JOB[:3], "trainer.devices=2",
                 *JOB[5:], f"hydra.run.dir={out}"], timeout=300, cwd=tmp)  # fmt: skip
    return out


def _wait_for(what: str, check, timeout: float) -> float:  # noqa: ANN001
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.05)
    return time.monotonic()


@pytest.mark.slow
def test_a_worker_killed_under_torchrun_elastic_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    agents = _agents(tmp_path, free_port())
    try:
        checkpoints = tmp_path / "run" / "checkpoints"
        complete = lambda: "step=8" in str(latest_checkpoint(checkpoints) or "")  # noqa: E731  (renamed into place)
        _wait_for("the step-8 checkpoint", complete, 240)
        workers = psutil.Process(agents[1].pid).children()
        assert len(workers) == 1, workers
        killed_at = time.monotonic()
        workers[0].send_signal(signal.SIGKILL)
        log = tmp_path / "agent1.log", tmp_path / "agent0.log"
        again = lambda: sum(p.read_text(errors="replace").count("resuming epoch 0 at sample") for p in log) > 0  # noqa: E731
        resumed_at = _wait_for("the restarted workers' first step", again, 240)
        codes = [agent.wait(timeout=240) for agent in agents]
        ended = time.monotonic()
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    logs = "".join((tmp_path / f"agent{n}.log").read_text(errors="replace") for n in range(2))
    assert codes == [0, 0], logs[-6000:]
    assert "ckpt_path=auto: resuming from" in logs and "epoch=0-step=8.ckpt" in logs, logs[-6000:]
    # The data position: 8 steps x 4 samples x 2 data-parallel ranks read before the checkpoint, none again.
    assert "resuming epoch 0 at sample 64 of" in logs, logs[-6000:]
    assert "Connection refused" not in logs
    # One W&B run, continued: both starts wrote under the same run id (the second from the checkpoint's step on).
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1, runs
    resumed = [row["trainer/global_step"] for row in history(read_records(next(runs[1].glob("run-*.wandb"))))
               if "train/loss" in row]  # fmt: skip
    assert min(resumed) == 8 and max(resumed) == 15, resumed
    # The same numbers as one uninterrupted run of the same job (one node, two processes: a two-node launch equals
    # it bit for bit): the training loss of every step trained after the restart, and the validation loss.
    done, reference = (
        json.loads((d / "summary.json").read_text()) for d in (tmp_path / "run", _uninterrupted(tmp_path))
    )
    assert done["losses"] == reference["losses"][8:] and len(reference["losses"]) == 16  # (this start's: 8 to 15)
    assert done["val_loss"] == reference["val_loss"] and done["steps"] == 16
    print(f"killed after the step-8 checkpoint; the job ended {ended - killed_at:.1f} s later; training again "
          f"{resumed_at - killed_at:.1f} s after the kill")  # fmt: skip
