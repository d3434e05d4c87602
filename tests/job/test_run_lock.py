"""One run per checkpoint directory: a second live run stops before any work, a dead one's lock is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from cuboid.job.run_lock import LOCK_NAME, RunDirectoryBusy, RunLock


def _plant(directory, **holder) -> None:
    """A lock written by another run (as its own acquire would have)."""
    directory.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": 1, "job": None, "started": time.time(), **holder}
    (directory / LOCK_NAME).write_text(json.dumps(record))


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_live_holder_on_this_host_makes_a_second_run_stop_with_its_name(tmp_path, other_process) -> None:
    _plant(tmp_path, pid=other_process, job="slurm:41")
    with pytest.raises(RunDirectoryBusy, match=rf"in use by another run \(host {socket.gethostname()}, pid "
                       rf"{other_process}, job slurm:41, started .*delete .*{LOCK_NAME}"):  # fmt: skip
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == other_process  # untouched


def test_a_fresh_lock_of_another_host_is_busy_and_a_stale_one_is_taken_over(tmp_path) -> None:
    _plant(tmp_path, host="node-elsewhere", pid=12345)
    with pytest.raises(RunDirectoryBusy, match="host node-elsewhere, pid 12345"):
        RunLock(tmp_path).acquire()
    old = time.time() - 600
    os.utime(tmp_path / LOCK_NAME, (old, old))
    lock = RunLock(tmp_path, stale_after=120)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_dead_holder_on_this_host_and_the_same_job_restarted_are_taken_over(tmp_path, monkeypatch) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _plant(tmp_path, pid=dead.pid)
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    _plant(tmp_path / "requeued", host="node-before", pid=999, job="slurm:77")
    lock = RunLock(tmp_path / "requeued")  # a requeued job on another node, within the stale time
    lock.acquire()
    assert json.loads((tmp_path / "requeued" / LOCK_NAME).read_text())["host"] == socket.gethostname()
    lock.release()


def test_the_lock_is_refreshed_while_held(tmp_path) -> None:
    lock = RunLock(tmp_path, refresh=0.2)
    lock.acquire()
    old = time.time() - 600
    os.utime(tmp_path / LOCK_NAME, (old, old))
    time.sleep(0.6)
    assert time.time() - (tmp_path / LOCK_NAME).stat().st_mtime < 5
    lock.release()
    assert not lock._thread


_FIT = """
import os, sys, time
import lightning as L, torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from cuboid import CuboidStrategy

class Slow(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        if sys.argv[2] == "wait" and self.global_step == 3:  # mid-run, until the other run has tried
            deadline = time.time() + 90
            while not os.path.exists(sys.argv[1] + "/second_done") and time.time() < deadline:
                time.sleep(0.1)
        return self.layer(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)
trainer = L.Trainer(accelerator="cpu", devices=1, strategy=CuboidStrategy(), max_steps=8, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[1],
                    callbacks=[ModelCheckpoint(dirpath=sys.argv[1] + "/checkpoints", every_n_train_steps=2, filename="{step}",
                                               save_top_k=-1)])
try:
    trainer.fit(Slow(), data)
except Exception as err:
    print("ERROR", type(err).__name__, err)
    sys.exit(1)
print("DONE", trainer.global_step)
"""


@pytest.mark.slow
def test_two_runs_in_one_directory_the_second_stops_and_the_first_is_untouched(tmp_path) -> None:
    """Run A trains 8 steps saving every 2 and waits at step 3; run B starts in the same directory then: B stops
    before its first step naming A; A finishes with its 4 checkpoints; the lock is gone after A. Without the lock
    B trains and saves step=2.ckpt ... over A's (checked by hand: it ran to "DONE 8")."""
    first = subprocess.Popen([sys.executable, "-c", _FIT, str(tmp_path), "wait"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.time() + 60
    while not (tmp_path / "checkpoints" / "step=2.ckpt").exists() and time.time() < deadline:
        time.sleep(0.1)
    second = subprocess.run([sys.executable, "-c", _FIT, str(tmp_path), "go"], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    (tmp_path / "second_done").touch()
    out, _ = first.communicate(timeout=120)
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"ERROR RunDirectoryBusy {tmp_path}/checkpoints is in use by another run (host" in second.stdout
    assert f"pid {first.pid}" in second.stdout
    assert first.returncode == 0 and "DONE 8" in out, out[-3000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt", "step=8.ckpt"], saved  # and no lock left
