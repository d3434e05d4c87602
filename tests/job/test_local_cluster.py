"""A real SLURM in the suite (issue 24, first part): ``scripts/slurm/local_cluster.sh`` brings up munge, slurmctld and
two slurmd (nodes n1, n2) on this machine in one private directory, and jobs go through SLURM's own commands with
the project's own ``scripts/slurm/train.sbatch``. Every command carries the private ``SLURM_CONF``; the session's
decoys (conftest) pass exactly those calls to the real commands and fail on any other. After the module, nothing of
the cluster is left: no daemon, no job, no process of a job, no directory.

Needs Debian's ``slurm-wlm`` and ``munge``: ``.ci/run`` installs them, so CI runs these; elsewhere they are skipped
with the command that installs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DECOY_LOG, PRIVATE_CONF_VAR
from harness import ROOT

SCRIPT = ROOT / "scripts" / "slurm" / "local_cluster.sh"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")


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


@pytest.mark.slow
def test_the_sbatch_script_trains_on_two_nodes_to_a_checkpoint_and_a_wandb_run(cluster: Path, tmp_path: Path) -> None:
    """``sbatch scripts/slurm/train.sbatch`` with CPU overrides only: one task per node on n1 and n2, six steps, the
    job's sharded checkpoint and its offline W&B run in its run directory."""
    job = _slurm(
        cluster,
        "sbatch", "--wait", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0",
        "--cpus-per-task=1", "--time=00:10:00", f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out",
        str(ROOT / "scripts" / "slurm" / "train.sbatch"),
        "trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.max_steps=6", "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=2", "data.max_bytes=300000", "data.seq_len=64", "data.batch_size=4",
        f"data.cache_dir={tmp_path / 'cache'}",
        timeout=420,
    )  # fmt: skip
    job_id = job.stdout.strip().split(";")[0]
    log = (tmp_path / f"slurm-{job_id}.out").read_text() if job_id.isdigit() else ""
    assert job.returncode == 0, f"{job.stderr}\n{log[-4000:]}"
    run = tmp_path / "outputs" / f"slurm-{job_id}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2, summary
    assert any((run / "checkpoints").iterdir()), "no checkpoint"
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    assert "Traceback" not in log, log[-4000:]
    shown = _slurm(cluster, "scontrol", "show", "job", job_id).stdout
    assert " NodeList=n[1-2]" in shown and "JobState=COMPLETED" in shown, shown
