"""The test harness: launching real multi-process runs (gloo on CPU) from pytest.

Each distributed test runs a worker script as a subprocess: Lightning's own launcher re-runs
``sys.argv``, which under pytest would be pytest itself. Startup costs several seconds per
process, so workers run several layouts per launch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
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
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "PYTHONFAULTHANDLER": "1",
        }
    )  # a worker that dies of a signal prints every thread's Python stack
    env.update(extra)
    return env


def run_checked(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT) -> str:
    """Run ``cmd``; on failure, fail the test with the tail of its output."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=env or worker_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        crash = out.find("Fatal Python error")  # a worker's native crash: faulthandler's stacks (PYTHONFAULTHANDLER)
        stacks = f"\n...\n{out[crash : crash + 4000]}\n...\n" if 0 <= crash < len(out) - 6000 else ""
        pytest.fail(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:{stacks}\n{out[-6000:]}")
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


def torchrun_session(nprocs: int, script: Path, *args: str, timeout: float = 60) -> tuple[int, str]:
    """Like :func:`torchrun`, in a session of its own that is killed whole on timeout (no worker outlives the
    test); returns the exit code and the output instead of failing on a non-zero one."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script), *args]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun starts each worker in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script.name} {' '.join(args)} did not finish in {timeout} s:\n{out[-6000:]}")
    return proc.returncode, out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def launch_and_watch(cmd: list[str], timeout: float) -> tuple[int, str, float, set[int]]:
    """Run ``cmd`` in a session of its own; return its exit code, output, the time its output closed (every
    process that held it gone) and every pid seen below it."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen: set[int] = set()
    done = threading.Event()

    def census() -> None:
        while not done.is_set():
            seen.update(descendants(proc.pid))
            time.sleep(0.2)

    threading.Thread(target=census, daemon=True).start()
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    reader.join(timeout)
    closed = time.time()
    done.set()
    if reader.is_alive():
        for pid in [proc.pid, *seen]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{cmd[1:]} still running after {timeout} s")
    return proc.wait(), "".join(chunks), closed, seen


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited process whose dead parent has not been reaped for it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
