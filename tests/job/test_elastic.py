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
import math
import re
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
       "trainer.max_steps=24", "trainer.val_check_interval=4", "trainer.log_every_n_steps=1"]  # fmt: skip
STEPS = 24


def _agents(tmp: Path, port: int) -> list[subprocess.Popen]:
    """Two torchrun agents of one elastic job, as two nodes would start them (each in a session of its own): the
    first with torchrun's flags, as a user types them; the second with none, configured by the ``PET_*`` variables
    Kubeflow's PyTorchJob operator sets in an elastic job's pods (torchrun reads ``PET_<FLAG>`` for each flag)."""
    flags = {"nnodes": "1:2", "nproc_per_node": "1", "max_restarts": "1", "rdzv_backend": "c10d",
             "rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": f"elastic{port}", "monitor_interval": "1"}  # fmt: skip
    job = [TRAIN, f"data.cache_dir={tmp / 'cache'}", *JOB, f"hydra.run.dir={tmp / 'run'}"]
    by_flags = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    by_env = {f"PET_{k.upper()}": v for k, v in flags.items()}
    started = []
    for n, (args, env) in enumerate([(by_flags, worker_env()), ([], worker_env(**by_env))]):
        with open(tmp / f"agent{n}.log", "w") as log:
            cmd = [sys.executable, "-m", "torch.distributed.run", *args, *job]
            started.append(subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))  # fmt: skip
    return started


def _wait_for(what: str, check, timeout: float) -> float:  # noqa: ANN001
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.05)
    return time.monotonic()


def _checkpoint_step(path: object) -> int:
    return int(re.search(r"step=(\d+)", str(path)).group(1)) if path else -1


def _run_with_a_fault(tmp: Path, kill: str) -> dict:
    """The job on two agents; once a checkpoint at step >= 8 is complete, SIGKILL ``kill``: ``"worker"`` (one
    worker of the agent that does not host the rendezvous) or ``"node"`` (that agent with its worker). Returns what
    happened: the agents' exit codes (None: killed), the step resumed from, seconds to training again, the logs."""
    port = free_port()
    agents = _agents(tmp, port)
    checkpoints, logs = tmp / "run" / "checkpoints", [tmp / f"agent{n}.log" for n in range(2)]
    try:
        _wait_for("a checkpoint at step 8 or later", lambda: _checkpoint_step(latest_checkpoint(checkpoints)) >= 8, 240)
        victim = next(a for a in agents if not _hosts_rendezvous(a, port))  # (a lost host cannot recover)
        killed_at = time.monotonic()
        workers = psutil.Process(victim.pid).children()
        assert len(workers) == 1, workers
        # (torchrun starts its workers in sessions of their own: a signal to the agent's group would miss them)
        everything = [psutil.Process(victim.pid), *psutil.Process(victim.pid).children(recursive=True)]
        for process in everything if kill == "node" else workers:
            process.send_signal(signal.SIGKILL)
        again = lambda: any("resuming epoch 0 at sample" in p.read_text(errors="replace") for p in logs)  # noqa: E731
        resumed_at = _wait_for("the restarted workers' first step", again, 240)
        codes = [None if (kill == "node" and a is victim) else a.wait(timeout=240) for a in agents]
    finally:
        _kill_all(agents)
    text = "".join(p.read_text(errors="replace") for p in logs)
    found = re.search(r"ckpt_path=auto: resuming from \S*step=(\d+)\.ckpt", text)
    assert found, text[-6000:]
    return {"codes": codes, "step": int(found.group(1)), "again_s": resumed_at - killed_at, "logs": text}


def _kill_all(agents: list[subprocess.Popen]) -> None:
    """Every agent of the test and its workers SIGKILLed, and reaped: nothing is left behind."""
    for agent in agents:
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in [*psutil.Process(agent.pid).children(recursive=True), psutil.Process(agent.pid)]:
                process.send_signal(signal.SIGKILL)
        agent.wait()


def _hosts_rendezvous(agent: subprocess.Popen, port: int) -> bool:
    procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for p in procs for c in p.net_connections())


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same job on one node's two processes (Lightning's launcher), uninterrupted: its summary."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run_checked([sys.executable, TRAIN, f"data.cache_dir={tmp / 'cache'}", *JOB[:3], "trainer.devices=2",
                 *JOB[5:], f"hydra.run.dir={tmp / 'run'}"], timeout=300, cwd=tmp)  # fmt: skip
    return _summary(tmp / "run")


@pytest.mark.slow
def test_a_worker_killed_under_torchrun_elastic_resumes_from_the_last_checkpoint(tmp_path: Path, uninterrupted) -> None:
    ran = _run_with_a_fault(tmp_path, "worker")
    step, logs = ran["step"], ran["logs"]
    assert ran["codes"] == [0, 0], logs[-6000:]
    assert step >= 8 and "Connection refused" not in logs
    # The data position: step x 4 samples x 2 data-parallel ranks read before the checkpoint, none again.
    assert f"resuming epoch 0 at sample {step * 8} of" in logs, logs[-6000:]
    # One W&B run, continued: both starts wrote under the same run id (the second from the checkpoint's step on).
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1, runs
    resumed = [row["trainer/global_step"] for row in history(read_records(next(runs[1].glob("run-*.wandb"))))
               if "train/loss" in row]  # fmt: skip
    assert min(resumed) == step and max(resumed) == STEPS - 1, resumed
    # The same numbers as one uninterrupted run of the same job (one node, two processes: a two-node launch equals
    # it bit for bit): the training loss of every step trained after the restart, and the validation loss.
    done = _summary(tmp_path / "run")
    assert done["losses"] == uninterrupted["losses"][step:] and len(uninterrupted["losses"]) == STEPS
    assert done["val_loss"] == uninterrupted["val_loss"] and done["steps"] == STEPS
    print(f"worker killed: resumed from step {step}, training again {ran['again_s']:.1f} s after the kill")


@pytest.mark.slow
def test_a_node_lost_under_torchrun_elastic_resumes_on_the_one_left(tmp_path: Path, uninterrupted) -> None:
    """``--nnodes 1:2``, one agent killed with its worker: the survivor's agent restarts, torchrun re-forms the
    job on the one node left, and the Trainer (given num_nodes=2) trains there at dp1, the checkpoint resharded, the
    data position kept (it counts samples over every data-parallel rank)."""
    ran = _run_with_a_fault(tmp_path, "node")
    step, logs = ran["step"], ran["logs"]
    assert 0 in ran["codes"], logs[-6000:]
    assert "torchrun formed this round with 1 node(s) of 1 process(es) (the Trainer was given num_nodes=2)" in logs
    assert "layout pp=1 x dp_replicate=1 x dp_shard=1 x tp=1" in logs, logs[-6000:]
    assert f"resuming epoch 0 at sample {step * 8} of" in logs, logs[-6000:]
    done = _summary(tmp_path / "run")
    assert done["world_size"] == 1 and done["steps"] == STEPS
    # Not the uninterrupted run's numbers: each step now reads one rank's batch of 4, not two ranks' 8. What it
    # shows: training went on from the checkpoint's weights (its first loss is near the uninterrupted run's at that
    # step, far from a fresh model's) to the last step.
    first, fresh, there = done["losses"][0], uninterrupted["losses"][0], uninterrupted["losses"][step]
    assert abs(first - there) < 0.5 * abs(fresh - there), (first, there, fresh)
    assert len(done["losses"]) == STEPS - step and all(math.isfinite(x) for x in done["losses"])
    print(f"node lost: resumed from step {step} on one node, training again {ran['again_s']:.1f} s after the kill")


@pytest.mark.slow
def test_a_pytorchjob_without_torchrun_trains_under_kubeflows_environment(tmp_path: Path, uninterrupted) -> None:
    """A PyTorchJob whose pods run the job without torchrun: one process each, given what Kubeflow's operator sets
    (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) and what every pod has (KUBERNETES_PORT). Lightning picks its
    KubeflowEnvironment; Cuboid prints the layout and trains as one node's two processes do, to the last digit."""
    port, procs = free_port(), []
    for rank in range(2):
        env = worker_env(KUBERNETES_PORT="tcp://10.96.0.1:443", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         WORLD_SIZE="2", RANK=str(rank))  # fmt: skip
        with open(tmp_path / f"pod{rank}.log", "w") as log:
            cmd = [
                sys.executable,
                TRAIN,
                f"data.cache_dir={tmp_path / 'cache'}",
                *JOB,
                f"hydra.run.dir={tmp_path / 'run'}",
            ]
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    logs = "".join((tmp_path / f"pod{rank}.log").read_text(errors="replace") for rank in range(2))
    assert codes == [0, 0], logs[-6000:]
    assert "Cuboid layout: pp=1 x dp_replicate=1 x dp_shard=2 x tp=1 on 2 processes" in logs
    done = _summary(tmp_path / "run")
    assert done["cluster_environment"] == "KubeflowEnvironment" and done["world_size"] == 2
    assert done["losses"] == uninterrupted["losses"] and done["val_loss"] == uninterrupted["val_loss"]


def _lose_the_rendezvous_host(tmp: Path) -> dict:
    """The job on two agents; once a checkpoint at step >= 8 is complete, SIGKILL the agent that hosts the
    rendezvous endpoint and its worker. Returns the survivor's exit code, the seconds until every process of it is
    gone, and its log."""
    port = free_port()
    agents = _agents(tmp, port)
    checkpoints = tmp / "run" / "checkpoints"
    try:
        _wait_for("a checkpoint at step 8 or later", lambda: _checkpoint_step(latest_checkpoint(checkpoints)) >= 8, 240)
        host = next(a for a in agents if _hosts_rendezvous(a, port))
        survivor = next(a for a in agents if a is not host)
        family = [psutil.Process(survivor.pid), *psutil.Process(survivor.pid).children(recursive=True)]
        killed_at = time.monotonic()
        for process in [psutil.Process(host.pid), *psutil.Process(host.pid).children(recursive=True)]:
            process.send_signal(signal.SIGKILL)
        code = survivor.wait(timeout=600)
        gone = _wait_for("the survivor's workers to exit", lambda: not any(p.is_running() and
                         p.status() != psutil.STATUS_ZOMBIE for p in family), 120)  # fmt: skip
    finally:
        _kill_all(agents)
    log = (tmp / f"agent{agents.index(survivor)}.log").read_text(errors="replace")
    return {"code": code, "ended_s": gone - killed_at, "log": log}


@pytest.mark.slow
def test_a_lost_rendezvous_host_ends_every_process_in_bounded_time(tmp_path: Path) -> None:
    """What cannot recover (issue 68): the node hosting ``--rdzv-endpoint`` lost with its worker. The survivor's
    worker stops (Cuboid's watchdog names the silent rank, or gloo's closed connection ends it) and its agent,
    which cannot reach the rendezvous to restart, exits non-zero with torchrun's one line saying so; every
    process of it is gone within a minute (measured: 0.9 to 6.9 s)."""
    ran = _lose_the_rendezvous_host(tmp_path)
    said = [line for line in ran["log"].splitlines() if line.startswith("torch.distributed.elastic.rendezvous")]
    assert ran["code"] == 1 and ran["ended_s"] < 60, (ran["code"], ran["ended_s"], ran["log"][-4000:])
    assert said and said[-1].endswith("RendezvousConnectionError: The connection to the C10d store has failed. See "
                                      "inner exception for details."), ran["log"][-4000:]  # fmt: skip
