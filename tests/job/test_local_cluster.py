"""A real SLURM in the suite (issue 24): ``scripts/slurm/local_cluster.sh`` brings up munge, slurmctld and two slurmd
(nodes n1, n2) on this machine in one private directory, and jobs go through SLURM's own commands with the project's
own ``scripts/slurm/train.sbatch`` and Hydra's SLURM launcher: a two-node job, preemption by ``scancel --signal=USR1``
and the job's own requeue, a task killed on one node, a job array, and a submitit sweep with a preempted point.
Every command carries the private ``SLURM_CONF``; the session's decoys (conftest) pass exactly those calls to the
real commands and fail on any other. After the module, nothing of the cluster is left: no daemon, no job, no
process of a job, no directory.

Needs Debian's ``slurm-wlm`` and ``munge``: ``.ci/run`` installs them, so CI runs these; elsewhere they are skipped
with the command that installs them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DECOY_LOG, PRIVATE_CONF_VAR
from harness import ROOT
from wandb_records import history, read_records

SCRIPT = ROOT / "scripts" / "slurm" / "local_cluster.sh"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
SBATCH = str(ROOT / "scripts" / "slurm" / "train.sbatch")
CPU = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=00:10:00"]  # what a CPU cluster needs on the command line
# The main job, CPU overrides only: 12 steps, a checkpoint every 4, the loss of every step logged.
STEPS = ["trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.max_steps=12", "trainer.val_check_interval=4",
         "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "data.max_bytes=300000", "data.seq_len=64",
         "data.batch_size=4"]  # fmt: skip
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


def _installed() -> bool:
    path = f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin{os.pathsep}/sbin"
    return all(shutil.which(name, path=path) for name in DAEMONS)


def _processes_mentioning(text: str) -> list[str]:
    """Processes whose command line or environment names ``text`` (the cluster's directory): its daemons, and every
    process of its jobs (they carry its SLURM_CONF)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            blob = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in blob:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name}: {command[:120]}")
    return found


def _cluster(directory: Path, *args: str) -> str:
    env = {**os.environ, "CUBOID_SLURM_DIR": str(directory), "PATH": f"{os.environ['PATH']}:/usr/sbin:/sbin"}
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"local_cluster.sh {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if not _installed():
        if os.environ.get("CI"):
            pytest.fail("SLURM's daemons are missing: .ci/run installs slurm-wlm and munge (apt-get) before the suite")
        pytest.skip("slurm-wlm and munge are not installed (apt-get install slurm-wlm munge); CI runs these tests")
    directory = tmp_path_factory.mktemp("slurm") / "cluster"
    conf = directory / "slurm.conf"
    os.environ[PRIVATE_CONF_VAR] = str(conf)  # the decoys let the script's own sinfo/squeue/scancel through
    try:
        _cluster(directory, "up")
        yield conf
    finally:
        _cluster(directory, "down")
        os.environ.pop(PRIVATE_CONF_VAR, None)
        left = _processes_mentioning(str(directory))
        assert not left and not directory.exists(), ("the local cluster left", left)


def _slurm(conf: Path, *cmd: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_CONF": str(conf)}
    return subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.slow
def test_up_is_idempotent_private_and_runs_a_step_on_both_nodes(cluster: Path) -> None:
    assert "already up" in _cluster(cluster.parent, "up")
    text = cluster.read_text()
    assert "/etc/" not in text and f"AuthInfo=socket={cluster.parent}/munge/munge.socket" in text
    step = _slurm(cluster, "srun", "--nodes=2", "--ntasks=2", "bash", "-c", 'echo "$SLURM_NODEID $SLURMD_NODENAME"')
    assert step.returncode == 0, step.stderr
    assert sorted(step.stdout.split("\n")[:2]) == ["0 n1", "1 n2"], step.stdout
    # the decoys passed these calls through (they carry the private SLURM_CONF) and recorded none
    assert not DECOY_LOG.exists() or not DECOY_LOG.read_text().strip()


def _submit(conf: Path, workdir: Path, *args: str, wait: bool = False) -> str:
    """``sbatch <args>`` from the repository (where a user runs it), the job's directory ``workdir``; the job id.
    ``wait``: until the job (each task of an array) has ended, asserting it COMPLETED. Polled here: ``sbatch --wait``
    polls at growing intervals (a 25 s job returned after 42 s)."""
    array = next((a.split("=")[1] for a in args if a.startswith("--array=")), None)
    output = f"--output={workdir}/slurm-%A_%a.out" if array else f"--output={workdir}/slurm-%j.out"
    job = _slurm(conf, "sbatch", "--parsable", f"--chdir={workdir}", output, *args)
    job_id = job.stdout.strip().split(";")[0]
    assert job.returncode == 0 and job_id.isdigit(), f"sbatch: {job.stdout}{job.stderr}"
    if wait:
        tasks = (
            [f"{job_id}_{t}" for t in range(int(array.split("-")[0]), int(array.split("-")[1]) + 1)]
            if array
            else [job_id]
        )
        for task in tasks:
            _wait_for(f"job {task} to end", lambda t=task: _job(conf, t).get("JobState") in ENDED, 400)
            state = _job(conf, task)["JobState"]
            assert state == "COMPLETED", f"job {task}: {state}\n{_log(workdir, task)[-4000:]}"
    return job_id


def _log(workdir: Path, job_id: str) -> str:
    path = workdir / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else ""


def _job(conf: Path, job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, Restarts, NodeList, ...)."""
    shown = _slurm(conf, "scontrol", "show", "job", job_id).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def _wait_for(what: str, ready, timeout: float) -> float:
    """Poll ``ready()`` every 0.2 s; the seconds it took."""
    start = time.monotonic()
    while not ready():
        assert time.monotonic() - start < timeout, f"waited {timeout} s for {what}"
        time.sleep(0.2)
    return time.monotonic() - start


def _job_processes(job_id: str) -> list[str]:
    """Processes of this job on either node (their environment names it), SLURM's own steps included."""
    return _processes_mentioning(f"\0SLURM_JOB_ID={job_id}\0")


def _pid_of_task(job_id: str, rank: int) -> int | None:
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"\0SLURM_JOB_ID={job_id}\0".encode() in env and f"\0SLURM_PROCID={rank}\0".encode() in env:
            if cmd.startswith(b"python") or b"/python" in cmd.split(b"\0")[0]:
                return int(proc.name)
    return None


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"data.cache_dir={tmp_path_factory.mktemp('tokens')}"


@pytest.fixture(scope="module")
def uninterrupted(cluster: Path, cache: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """The main job on two nodes, 12 steps, not interrupted: (its directory, job id, log)."""
    workdir = tmp_path_factory.mktemp("whole")
    job_id = _submit(cluster, workdir, "--nodes=2", "--ntasks-per-node=1", *CPU, SBATCH, *STEPS, cache, wait=True)
    return workdir, job_id, _log(workdir, job_id)


@pytest.mark.slow
def test_the_sbatch_script_trains_on_two_nodes_to_a_checkpoint_and_a_wandb_run(
    cluster: Path, uninterrupted: tuple[Path, str, str]
) -> None:
    """``sbatch scripts/slurm/train.sbatch`` with CPU overrides only: one task per node on n1 and n2, the job's
    sharded checkpoint and its offline W&B run in its run directory, a log without a traceback."""
    workdir, job_id, log = uninterrupted
    run = workdir / "outputs" / f"slurm-{job_id}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["world_size"] == 2, summary
    assert summary["cluster_environment"] == "SLURMEnvironment"
    assert any((run / "checkpoints").iterdir()), "no checkpoint"
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    assert "Traceback" not in log and "error" not in log.lower(), log[-4000:]
    shown = _job(cluster, job_id)
    assert shown["NodeList"] == "n[1-2]" and shown["JobState"] == "COMPLETED" and shown["Restarts"] == "0", shown


def _clean(log: str) -> list[str]:
    """What a user reads as trouble in a job's log: tracebacks, errors, killed tasks. SLURM's own notice of a
    requeue (``slurmstepd: error: *** JOB N ON n1 CANCELLED AT ... DUE TO JOB REQUEUE ***``, which slurmstepd prints
    when the request reaches the node before the batch script has ended; 'Not really errors', says its source) is
    not ours to silence and is left out."""
    bad = ("Traceback", "error", "Error", "Terminated", "Killed", "Connection")
    return [line for line in log.splitlines() if any(b in line for b in bad) and "DUE TO JOB REQUEUE" not in line]


def _two_nodes_at_step_4(conf: Path, workdir: Path, *overrides: str) -> tuple[str, Path]:
    """The sbatch script on two nodes (one task each), returned once its step-4 checkpoint exists: (job id, run
    directory)."""
    job_id = _submit(conf, workdir, "--nodes=2", "--ntasks-per-node=1", *CPU, SBATCH, *overrides)
    run = workdir / "outputs" / f"slurm-{job_id}"

    def at_step_4() -> bool:
        assert _job(conf, job_id).get("JobState") in ("PENDING", "RUNNING"), _log(workdir, job_id)[-4000:]
        return any((run / "checkpoints").glob("*step=4.ckpt"))

    _wait_for(f"job {job_id}'s step-4 checkpoint", at_step_4, 240)
    return job_id, run


@pytest.mark.slow
def test_preempted_by_scancel_usr1_the_job_requeues_itself_and_resumes_the_same_curve_and_wandb_run(
    cluster: Path, uninterrupted: tuple[Path, str, str], cache: str, tmp_path: Path
) -> None:
    """``scancel --signal=USR1`` mid-run (after the step-4 checkpoint): every task saves one checkpoint and exits 0,
    the batch script requeues the job (``Restarts=1``, same id), which resumes in the same run directory and W&B
    run; its losses equal the uninterrupted job's, and its log has no traceback and no error line."""
    job_id, run = _two_nodes_at_step_4(cluster, tmp_path, *STEPS, cache)
    sent = _slurm(cluster, "scancel", "--signal=USR1", job_id)
    assert sent.returncode == 0, sent.stderr
    _wait_for("the requeued job to end", lambda: _job(cluster, job_id).get("JobState") in ENDED, 300)
    shown, log = _job(cluster, job_id), _log(tmp_path, job_id)
    assert shown["JobState"] == "COMPLETED" and shown["Restarts"] == "1", (shown, log[-4000:])
    saved = list((run / "checkpoints").glob("preempted-step=*.ckpt"))
    assert len(saved) == 1, (saved, log[-4000:])
    n = int(saved[0].name.split("=")[1].split(".")[0])
    assert 4 <= n < 12, n
    assert not _clean(log), _clean(log)
    assert f"resuming from {saved[0]}" in log and f"requeueing job {job_id}" in log, log[-4000:]

    whole = json.loads((uninterrupted[0] / "outputs" / f"slurm-{uninterrupted[1]}" / "summary.json").read_text())
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 12 and resumed["losses"] == pytest.approx(whole["losses"][n:], rel=1e-5)
    assert resumed["val_ppl"] == pytest.approx(whole["val_ppl"], rel=1e-5)
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({p.name.rsplit("-", 1)[1] for p in runs}) == 1, runs  # one W&B run, two starts
    first = {r["trainer/global_step"]: r["train/loss"] for r in history(read_records(next(runs[0].glob("*.wandb"))))
             if "train/loss" in r}  # fmt: skip
    assert sorted(first) == list(range(n)) and [first[s] for s in range(n)] == pytest.approx(whole["losses"][:n])
    assert not _job_processes(job_id)


@pytest.mark.alone  # its seconds are bounded
@pytest.mark.slow
def test_a_task_killed_on_one_node_ends_the_whole_job_within_seconds_naming_the_dead_rank(
    cluster: Path, cache: str, tmp_path: Path
) -> None:
    """SIGKILL to task 1 (on n2) mid-run: srun ends the step on both nodes, the job fails within seconds, its log
    names the dead task, and no process of the job is left on either node."""
    job_id, _ = _two_nodes_at_step_4(cluster, tmp_path, *STEPS[:2], "trainer.max_steps=100000", *STEPS[3:], cache)
    pid = _pid_of_task(job_id, 1)
    assert pid is not None, _job_processes(job_id)
    os.kill(pid, signal.SIGKILL)
    took = _wait_for("the job to end", lambda: _job(cluster, job_id).get("JobState") in ENDED, 60)
    shown, log = _job(cluster, job_id), _log(tmp_path, job_id)
    assert shown["JobState"] == "FAILED", shown
    assert took < 20, (took, log[-3000:])
    assert "srun: error: n2: task 1: Killed" in log, log[-3000:]
    _wait_for("no process of the job", lambda: not _job_processes(job_id), 15)


@pytest.mark.slow
def test_a_job_array_gives_each_task_its_own_run_directory_and_wandb_run(
    cluster: Path, cache: str, tmp_path: Path
) -> None:
    """``sbatch --array=0-1``: two one-node jobs, each in ``outputs/slurm-<array job>_<task>`` with its own summary,
    checkpoint and W&B run."""
    short = [*STEPS[:2], "trainer.max_steps=2", "trainer.val_check_interval=2", *STEPS[4:]]
    job_id = _submit(cluster, tmp_path, "--array=0-1", "--nodes=1", "--ntasks-per-node=1", *CPU, SBATCH, *short,
                     cache, wait=True)  # fmt: skip
    ids = set()
    for task in (0, 1):
        run = tmp_path / "outputs" / f"slurm-{job_id}_{task}"
        log = _log(tmp_path, f"{job_id}_{task}")
        assert json.loads((run / "summary.json").read_text())["steps"] == 2, log[-3000:]
        assert any((run / "checkpoints").iterdir())
        runs = list((run / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, runs
        ids.add(runs[0].name.rsplit("-", 1)[1])
        assert not _clean(log), _clean(log)
    assert len(ids) == 2, ids


@pytest.mark.slow
def test_a_hydra_sweep_through_submitit_runs_each_point_on_two_nodes_and_a_preempted_point_resumes(
    cluster: Path, uninterrupted: tuple[Path, str, str], cache: str, tmp_path: Path
) -> None:
    """``scripts/train.py -m hydra/launcher=slurm`` with CPU overrides on the command line only: one SLURM job per
    sweep point (a submitit array), each on n1 and n2 in its own run directory. Point 0 is preempted by
    ``scancel --signal=USR1`` after its step-4 checkpoint: it requeues itself as the sbatch path does and resumes into
    the same W&B run, and its losses equal the uninterrupted sbatch job's (the same training). Point 1 trains 2
    steps."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "-m", "hydra/launcher=slurm", "trainer=multinode",
           "trainer.num_nodes=2", "trainer.devices=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
           *[s for s in STEPS if not s.startswith("trainer.max_steps=")], cache, f"hydra.sweep.dir={sweep}",
           "trainer.max_steps=12,2"]  # fmt: skip
    env = {**os.environ, "SLURM_CONF": str(cluster)}
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def point_0_at_step_4() -> bool:
            assert launcher.poll() is None, launcher.communicate()[0][-4000:]
            return any((sweep / "0" / "checkpoints").glob("*step=4.ckpt"))

        _wait_for("sweep point 0's step-4 checkpoint", point_0_at_step_4, 300)
        jobs = _slurm(cluster, "squeue", "-h", "-o", "%i").stdout.split()
        point_0 = next(job for job in jobs if job.endswith("_0"))
        sent = _slurm(cluster, "scancel", "--signal=USR1", point_0)
        assert sent.returncode == 0, sent.stderr
        out = launcher.communicate(timeout=400)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out[-4000:]
    assert _job(cluster, point_0)["Restarts"] == "1"
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["steps"] for s in summaries] == [12, 2] and all(s["world_size"] == 2 for s in summaries), summaries
    assert all(s["cluster_environment"] == "SLURMEnvironment" for s in summaries)
    saved = list((sweep / "0" / "checkpoints").glob("preempted-step=*.ckpt"))
    assert len(saved) == 1 and not list((sweep / "1" / "checkpoints").glob("preempted-step=*.ckpt")), saved
    n = int(saved[0].name.split("=")[1].split(".")[0])
    whole = json.loads((uninterrupted[0] / "outputs" / f"slurm-{uninterrupted[1]}" / "summary.json").read_text())
    assert summaries[0]["losses"] == pytest.approx(whole["losses"][n:], rel=1e-5), n
    runs = sorted((sweep / "0" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({p.name.rsplit("-", 1)[1] for p in runs}) == 1, runs
    logs = "".join(p.read_text() for p in sorted((sweep / ".submitit").glob("*/*_log.*")))
    assert not _clean(logs), _clean(logs)
    assert "requeueing job" in logs, logs[-4000:]
    submission = next((sweep / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "#SBATCH --signal=USR1@120" in submission and "gpu" not in submission, submission  # none asked on CPUs


def test_the_slurm_launcher_asks_for_gpus_on_gpus_and_for_none_on_cpus() -> None:
    """``hydra/launcher=slurm`` follows the Trainer: 8 GPUs per node for ``trainer=multinode``, no ``--gpus-per-node``
    at all with ``trainer.accelerator=cpu`` (a CPU cluster refuses a GPU request), from the command line alone."""
    from hydra import compose, initialize_config_module

    base = ["hydra/launcher=slurm", "trainer=multinode"]
    with initialize_config_module("cuboid.conf", version_base="1.3"):
        gpu = compose("train", overrides=base, return_hydra_config=True).hydra.launcher
        cpu = compose(
            "train", overrides=[*base, "trainer.accelerator=cpu", "trainer.devices=1"], return_hydra_config=True
        )
    assert (gpu.nodes, gpu.tasks_per_node, gpu.gpus_per_node) == (2, 8, 8)
    assert (cpu.hydra.launcher.tasks_per_node, cpu.hydra.launcher.gpus_per_node) == (1, None)
    assert cpu.hydra.launcher.additional_parameters.signal == "USR1@120"
