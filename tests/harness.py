"""The test harness: launching real multi-process runs (gloo on CPU) from pytest.

Each distributed test runs a worker script as a subprocess: Lightning's own launcher re-runs
``sys.argv``, which under pytest would be pytest itself. Startup costs several seconds per
process, so workers run several layouts per launch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    env.update(extra)
    return env


def run_checked(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT) -> str:
    """Run ``cmd``; on failure, fail the test with the tail of its output."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=env or worker_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{out[-6000:]}")
    return out


def torchrun(nprocs: int, script: Path, *args: str, timeout: float = 600) -> str:
    """Launch ``script`` on ``nprocs`` local processes with torchrun (TorchElastic environment)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nprocs}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]
    return run_checked(cmd, timeout)
