"""The suite's launcher (tests/forkserver.py through tests/harness.py): a forked rank sees what a torchrun worker
sees, and a server whose suite died takes everything it started with it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from harness import ROOT, WORKERS, running, torchrun, worker_env


def test_a_forked_rank_sees_what_a_torchrun_worker_sees() -> None:
    out = torchrun(2, WORKERS / "env_worker.py", "an-arg")
    seen = sorted(
        (json.loads(line[5:]) for line in out.splitlines() if line.startswith("SEEN ")), key=lambda s: s["RANK"]
    )
    assert [(s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["GROUP_RANK"]) for s in seen] == [
        ("0", "0", "2", "2", "0"),
        ("1", "1", "2", "2", "0"),
    ]
    assert all(s["TORCHELASTIC_RUN_ID"] for s in seen)  # Lightning and Cuboid see a TorchElastic launch
    assert all(s["argv"] == ["an-arg"] and s["path0"] == str(WORKERS) and s["cwd"] == str(ROOT) for s in seen)
    assert all(s["main"] == str(WORKERS / "env_worker.py") for s in seen)
    assert [s["zero"] for s in seen] == [0, 1] and all(s["total"] == 1.0 for s in seen)  # read again per rank


def test_a_server_whose_suite_died_stops_and_removes_its_directory() -> None:
    """A suite killed before its end (no pytest_unconfigure) leaves no fork server and no socket directory."""
    code = (
        f"import os, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import harness; harness.FORKSERVER.start(); "
        "print(harness.FORKSERVER.proc.pid, harness.FORKSERVER.dir, flush=True); os._exit(0)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=180)
    pid, where = out.stdout.split()
    deadline = time.monotonic() + 15
    while running(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(int(pid)), "the orphaned fork server is still running"
    from pathlib import Path

    assert not Path(where).exists()


def test_an_alone_test_waits_for_the_others_and_holds_them_off(tmp_path, monkeypatch) -> None:
    """harness.SuiteLock (pytest -n N): an exclusive hold waits for the shared one in progress, and a shared request
    made while it waits queues behind it; a hold inside a hold of the same process is part of it."""
    import threading

    from harness import SuiteLock

    monkeypatch.setenv("CUBOID_SUITE_LOCK", str(tmp_path / "suite.lock"))
    events: list[str] = []
    first_in, let_first_go = threading.Event(), threading.Event()

    def first() -> None:  # a worker's test in progress
        lock = SuiteLock()
        with lock.hold():
            with lock.hold(exclusive=True):  # nested: no second request, no deadlock with itself
                events.append("first in")
            first_in.set()
            let_first_go.wait(10)
            events.append("first out")

    def alone() -> None:
        first_in.wait(10)
        with SuiteLock().hold(exclusive=True):
            events.append("alone in")
            time.sleep(0.2)
            events.append("alone out")

    def later() -> None:
        with SuiteLock().hold():
            events.append("later in")

    threads = [threading.Thread(target=first), threading.Thread(target=alone)]
    for thread in threads:
        thread.start()
    first_in.wait(10)
    time.sleep(0.3)  # the exclusive request is queued
    threads.append(threading.Thread(target=later))
    threads[-1].start()
    time.sleep(0.3)
    assert events == ["first in"]
    let_first_go.set()
    for thread in threads:
        thread.join(10)
    assert events == ["first in", "first out", "alone in", "alone out", "later in"]
