"""What the benchmark suites share: relaunching a suite under torchrun, the per-world launches, and the JSON they
write. Suites import it as ``launch`` (``scripts/bench/`` is on their path)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch


def worker_or_relaunch(
    script: str,
    parser: argparse.ArgumentParser,
    worker: Callable[[argparse.Namespace], None],
    argv: list[str] | None = None,
    nprocs: int | None = None,
) -> None:
    """A suite's entry point: under torchrun (``--worker``) run ``worker(args)``; otherwise relaunch ``script``
    there on ``nprocs`` processes (default: ``--devices``)."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    relaunch_under_torchrun(script, nprocs or args.devices, argv if argv is not None else sys.argv[1:])


def relaunch_under_torchrun(script: str, nprocs: int, argv: list[str]) -> None:
    """Run ``script --worker ARGV`` on ``nprocs`` local processes (torchrun, a free loopback port); exit with its code."""
    sys.exit(subprocess.call(relaunch_cmd(script, nprocs, argv)))


def relaunch_cmd(script: str, nprocs: int, argv: list[str]) -> list[str]:
    """The torchrun command that runs ``script --worker ARGV`` on ``nprocs`` local processes (a free port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nprocs}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        script,
        "--worker",
        *argv,
    ]


def per_world_parser(doc: str, worlds: str, out: str) -> argparse.ArgumentParser:
    """The options the per-world suites share: ``--world`` (repeatable; ``worlds`` says which), ``--out``, and the
    hidden ``--worker`` / ``--part`` that :func:`launch_per_world` gives the processes it starts."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, action="append", default=None, help=f"{worlds} (repeatable)")
    parser.add_argument("--out", default=out)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    return parser


def launch_per_world(script: str, suite: str, worlds: list[int], forwarded: list[str]) -> list[Any]:
    """For each world size, run ``script --worker FORWARDED --part FILE`` under torchrun and collect the list its
    rank 0 wrote to FILE (the suites that run 2-, 4- and 8-process layouts)."""
    results: list[Any] = []
    for world in worlds:
        part = Path(f"/tmp/cuboid-{suite}-{world}.json")
        part.unlink(missing_ok=True)
        code = subprocess.call(relaunch_cmd(script, world, [*forwarded, "--part", str(part)]))
        if code != 0:
            sys.exit(f"bench {suite}: the {world}-process launch exited {code}")
        results += json.loads(part.read_text())
    return results


def write_results(out: str, meta: dict[str, Any], results: list[Any]) -> None:
    """``{machine, versions, meta..., results}`` as JSON to ``out``."""

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    base = {"machine": "CPU, gloo", "torch": torch.__version__, "lightning": L.__version__}
    path.write_text(json.dumps({**base, **meta, "results": results}, indent=1))
    print(f"wrote {path}")


def shared_tempdir(strategy: Any, prefix: str) -> Path:
    """A scratch directory rank 0 makes (and removes at the end), its path broadcast to every rank."""
    import tempfile

    return Path(strategy.broadcast(tempfile.mkdtemp(prefix=prefix) if strategy.global_rank == 0 else None))


class SetupMeasured(Exception):
    """Raised by ``SetupClock(stop=True)`` at the first step's start: the set-up was all that was wanted."""


class SetupClock(L.Callback):
    """Seconds from the Trainer's ``setup`` hook (before ``configure_model``) to ``on_train_start``: the strategy's
    set-up and a checkpoint's restore (the device synchronized at both ends on a GPU). ``stop``: raise
    :class:`SetupMeasured` there, so that no step runs."""

    def __init__(self, stop: bool = False) -> None:
        self.stop, self.start, self.seconds = stop, 0.0, float("nan")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
        if self.stop:
            raise SetupMeasured
