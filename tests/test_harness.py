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


def test_a_fixture_run_ahead_gives_its_result_or_its_failure_and_nothing_starts_once_closed(
    tmp_path_factory, monkeypatch
) -> None:
    """tests/ahead.py: what ran in the background is what its module's fixture gets (a pytest.fail is raised there,
    in the module that reads it); its processes run at nice 19 with the session's environment, not one a test
    changed meanwhile; once closed no further fixture starts, and one that did not start runs in the foreground."""
    import os
    import threading

    import pytest
    from ahead import Ahead
    from harness import run_checked

    ahead, gate = Ahead(), threading.Event()

    # The session's niceness reads "/autogroup-N nice K". A kernel without autogroups has no such file, and a
    # process in the kernel's default group (no autogroup of its own: CI's sandbox runs the suite there) reads it
    # empty ("-"), while a new session (setsid) gets an autogroup of its own and reads it well-formed. So what a
    # launch should see depends on its session: the suite's, as a child of it reads it, or a new one, as a child in
    # a new session reads it untouched (which also tells whether a launch's session can be lowered at all).
    group = "/proc/self/autogroup"
    read = f"(lambda w: w[-1] if len(w) == 3 else '-')(open({group!r}).read().split() if os.path.exists({group!r}) else [])"
    probe = f"import os; print(os.nice(0), {read}, os.environ['PROBE'], os.environ.get('CUBOID_PEER_TIMEOUT', '-'))"

    def child(new_session: bool = False) -> str:  # what a child reads for its session's niceness
        argv = [sys.executable, "-c", f"import os; print({read})"]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, start_new_session=new_session, check=True
        )
        return done.stdout.strip()

    here, ours = eval(read), child()  # the suite's own process's reading, and its session's as a child reads it
    untouched = child(new_session=True)  # what a new session reads before anyone lowers it
    grouped = untouched != "-"

    def seen(factory) -> list[list[str]]:  # what a launch's process sees, forked then fresh
        return [run_checked([sys.executable, "-c", probe], 120, fresh=fresh).split() for fresh in (False, True)]

    def fails(factory) -> None:
        pytest.fail("spec x left no result")

    def blocks(factory) -> str:
        gate.wait(60)
        return str(factory.mktemp("ahead").is_dir())

    def thread(factory) -> str:
        return threading.current_thread().name

    for body in (seen, fails, blocks, thread):
        ahead.offer(f"tests/m.py::{body.__name__}", body)
    monkeypatch.setenv("PROBE", "the session's")
    ahead.plan([f"tests/m.py::{body.__name__}" for body in (seen, fails, blocks, thread)], os.environ)
    monkeypatch.setenv("PROBE", "a test's")
    ahead.start()  # nothing runs before the session's tmp_path_factory is handed over
    time.sleep(0.3)
    assert ahead.state == {}
    ahead.provide(tmp_path_factory)
    deadline = time.monotonic() + 120
    while ahead.state.get("tests/m.py::blocks") != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    ahead.close()
    gate.set()
    ahead.quiet()
    assert ahead.state == dict.fromkeys(["tests/m.py::seen", "tests/m.py::fails", "tests/m.py::blocks"], "done")
    niceness = ["19", "19" if grouped else "-"]
    assert ahead.take("tests/m.py::seen", seen, tmp_path_factory) == [[*niceness, "the", "session's", "300"]] * 2
    assert (eval(read), child()) == (here, ours)  # the suite's own session keeps its priority
    with pytest.raises(pytest.fail.Exception, match="spec x left no result"):
        ahead.take("tests/m.py::fails", fails, tmp_path_factory)
    assert ahead.take("tests/m.py::blocks", blocks, tmp_path_factory) == "True"
    assert ahead.take("tests/m.py::thread", thread, tmp_path_factory) == threading.current_thread().name
    # Once closed, a launch runs in the foreground, not lowered. Forked from the fork server it is in a session of its
    # own (the server's agent calls setsid) and reads what an untouched new session reads; a fresh interpreter stays
    # in the suite's session. (CI at 3567d96 told them apart: the suite's session read "-", an agent's "0".)
    own = "os.getsid(0) != int(os.environ['SUITE_SID'])"
    env = {**worker_env(), "SUITE_SID": str(os.getsid(0))}
    forked = os.environ.get("CUBOID_TEST_LAUNCH") != "torchrun"
    for fresh in (False, True):
        out = run_checked([sys.executable, "-c", f"import os; print(os.nice(0), {read}, {own})"], 120, env, fresh=fresh)
        assert out.split() == [str(os.nice(0)), untouched if forked and not fresh else ours, str(forked and not fresh)]


def test_a_fixture_stuck_ahead_fails_its_tests_with_every_threads_stack_and_nothing_more_runs_ahead(
    tmp_path_factory, monkeypatch
) -> None:
    """tests/ahead.py: a fixture that has run ahead for ``STUCK`` seconds (here 0.5) fails the tests that read it,
    with the suite's threads' stacks (the background thread's shows where it is stuck), instead of the whole run
    waiting for it; the fixtures queued after it run in the foreground, and an ``alone`` test's wait ends."""
    import os
    import re
    import threading

    import ahead as ahead_module
    import pytest

    monkeypatch.setattr(ahead_module, "STUCK", 0.5)
    ahead, gate = ahead_module.Ahead(), threading.Event()

    def stuck_here(factory) -> str:
        gate.wait(60)
        return "late"

    def later(factory) -> str:
        return threading.current_thread().name

    keys = ["tests/m.py::stuck_here", "tests/m.py::later"]
    ahead.offer(keys[0], stuck_here)
    ahead.offer(keys[1], later)
    ahead.plan(keys, os.environ)
    ahead.provide(tmp_path_factory)
    ahead.start()
    try:
        deadline = time.monotonic() + 60
        while ahead.state.get(keys[0]) != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        pattern = r"tests/m.py::stuck_here has run ahead for \d+ s \(the limit: 0.5 s\).*in stuck_here"
        with pytest.raises(pytest.fail.Exception, match=re.compile(pattern, re.S)):
            ahead.take(keys[0], stuck_here, tmp_path_factory)
        assert ahead.take(keys[1], later, tmp_path_factory) == threading.current_thread().name
        assert keys[1] not in ahead.state
        ahead.quiet()  # returns, though one is still running
    finally:
        gate.set()


def test_a_launch_that_runs_ahead_gets_a_longer_limit_than_one_in_the_foreground() -> None:
    """A launch at nice 19 (tests/ahead.py's thread) gets only the cores the foreground leaves: its wall-clock limit
    is harness.AHEAD_LIMIT_SCALE times the one it asks for, and a foreground launch keeps its own."""
    import os
    import threading

    import harness

    limits: dict[str, float] = {}

    def background() -> None:
        harness.LOCAL.environ = {**os.environ, "CUBOID_TEST_NICE": "19"}
        limits["ahead"] = harness.launch(1, WORKERS / "env_worker.py", timeout=100).limit

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    limits["foreground"] = harness.launch(1, WORKERS / "env_worker.py", timeout=100).limit
    assert limits == {"ahead": 100 * harness.AHEAD_LIMIT_SCALE, "foreground": 100}
    assert harness.AHEAD_LIMIT_SCALE > 1
