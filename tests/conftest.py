"""pytest hooks only; the helpers tests use live in harness.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

# SLURM's commands, shadowed for the whole session by decoys: a call that carries the suite's own cluster's
# SLURM_CONF (tests/job/test_local_cluster.py brings it up, scripts/slurm/local_cluster.sh) goes to the real command;
# any other is recorded and fails (tests that simulate SLURM with its variables must never reach a real controller:
# on a cluster's login node job 4242 may be someone's).
SLURM_COMMANDS = ("sbatch", "srun", "scancel", "scontrol", "squeue", "sacct", "sinfo")
PRIVATE_CONF_VAR = "CUBOID_TEST_SLURM_CONF"  # set by the local-cluster fixture to its slurm.conf
_DECOY_PREFIX = os.path.join(tempfile.gettempdir(), "cuboid-slurm-decoys-")
_DECOYS = Path(tempfile.mkdtemp(prefix="cuboid-slurm-decoys-"))
DECOY_LOG = _DECOYS / "calls.log"


def pytest_configure(config) -> None:
    # The suite's own interpreter first: what the tests start as `python` (SLURM jobs, Lightning's launcher, shell
    # scripts) is the interpreter running the suite, also from a virtual environment that was not activated.
    here = os.path.dirname(sys.executable)
    # (a worker of pytest -n N inherits the controller's PATH: its decoys make way for the worker's own)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if not p.startswith(_DECOY_PREFIX))
    if path.split(os.pathsep)[0] != here:
        path = f"{here}{os.pathsep}{path}"
    for name in SLURM_COMMANDS:
        real = shutil.which(name, path=path)
        through = f'if [ -n "$SLURM_CONF" ] && [ "$SLURM_CONF" = "${PRIVATE_CONF_VAR}" ]; then exec {real} "$@"; fi\n'
        decoy = _DECOYS / name
        decoy.write_text(
            "#!/bin/sh\n"
            + (through if real else "")
            + f'echo "{name} $* (SLURM_CONF=$SLURM_CONF)" >> {DECOY_LOG}\nexit 1\n'
        )
        decoy.chmod(0o755)
    os.environ["PATH"] = f"{_DECOYS}{os.pathsep}{path}"
    # Several workers (pytest -n N): the lock that keeps the timed fault tests alone (harness.SuiteLock), made by the
    # controller before its workers start, so that they inherit its path.
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ["CUBOID_SUITE_LOCK"] = str(_DECOYS / "suite.lock")


def pytest_collection_modifyitems(config, items) -> None:
    """The quick tier (``-m quick``): every test not marked slow joins it; a slow one joins by its own mark."""
    for item in items:
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)
    if hasattr(config, "workerinput"):  # a worker of pytest -n N: the modules that take longest start first
        first = {module: rank for rank, module in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))


def pytest_collection_finish(session) -> None:
    """One pytest process: the waiting modules first, and the fixtures that may run ahead meanwhile (tests/ahead.py).
    ``CUBOID_TEST_AHEAD=0`` keeps the order of collection and runs nothing ahead."""
    config = session.config
    if getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        return
    if os.environ.get("CUBOID_TEST_AHEAD", "1") == "0":
        return
    from ahead import AHEAD

    waiting = {module: rank for rank, module in enumerate(WAITING)}
    order = {id(item): i for i, item in enumerate(session.items)}

    def key(item) -> tuple:
        module = item.nodeid.split("::")[0]
        alone = item.get_closest_marker("alone") is not None
        return (waiting.get(module, len(waiting)), not alone if module in waiting else False, order[id(item)])

    session.items.sort(key=key)
    alone = {i for i, item in enumerate(session.items) if item.get_closest_marker("alone")}
    last_alone = max(alone, default=-1)
    for i, item in enumerate(session.items):
        if i in alone:
            _PHASE[item.nodeid] = "quiet"
        elif i > last_alone:
            _PHASE[item.nodeid] = "open"
    # The fixtures a selected test needs, those of the end of the run first: the foreground comes from its front, so
    # it seldom reaches one that is still running (and then waits for it while it runs alone, at full speed).
    needed: dict[str, None] = {}
    for item in reversed(session.items):
        module = item.nodeid.split("::")[0]
        if module not in waiting:
            needed.update(dict.fromkeys(f"{module}::{name}" for name in item.fixturenames))
    AHEAD.plan([key for key in needed if key in AHEAD.offered], os.environ)


_PHASE: dict[str, str] = {}  # nodeid -> what runs ahead meanwhile: "open" (fixtures may start), "quiet" (nothing)

# The modules that wait more than they compute (idle core-seconds of the 2-core machine at fda05e8, of the
# module's seconds), run first in one pytest process: those with timed tests (marked alone: nothing runs ahead
# while they run, and they run first in their modules) lead.
WAITING = (
    "tests/job/test_hangs.py",  # 11 of 20
    "tests/job/test_stopping.py",  # 67 of 60
    "tests/job/test_local_cluster.py",  # 84 of 104
    "tests/replicas/test_fault_tolerance.py",  # 72 of 52
    "tests/test_install.py",  # 54 of 62
    "tests/job/test_shell.py",  # 52 of 82
    "tests/job/test_quiet_run.py",  # 27 of 34
    "tests/job/test_run_lock.py",  # 12 of 12
)


@pytest.fixture(scope="session", autouse=True)
def _ahead_factory(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Where the fixtures that run ahead make their directories (tests/ahead.py)."""
    if _PHASE:
        from ahead import AHEAD

        AHEAD.provide(tmp_path_factory)


# The modules that take longest (seconds of the whole module on the 2-core machine, serial run at a9ecaf3), started
# first under pytest -n N, so that no long module starts while the other workers are finishing; the rest follow in
# the order of collection. Each module runs whole on one worker (its module fixture runs once).
LONGEST_FIRST = (
    "tests/parallel/test_parity.py",  # 200
    "tests/job/test_local_cluster.py",  # 175, mostly SLURM's waits
    "tests/job/test_shell.py",  # 120
    "tests/context/test_context_parallel.py",  # 110
    "tests/job/test_stopping.py",  # 86
    "tests/test_install.py",  # 80
    "tests/experts/test_expert_parallel.py",  # 75
    "tests/job/test_exit.py",  # 73
    "tests/checkpoint/test_checkpoint.py",  # 60
    "tests/pipeline/test_pipeline_hf.py",  # 55
    "tests/job/test_hangs.py",  # 50
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest -n N hands out whole modules (their module fixtures run once), in the order the workers collected them
    (LONGEST_FIRST, then the rest)."""
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest -n N a test marked ``alone`` runs while no other worker runs a test (harness.SuiteLock); with
    CUBOID_TEST_CPU_LOG, each test's CPU-seconds and seconds are written there."""
    import harness

    phase = _PHASE.get(item.nodeid)
    if phase:
        from ahead import AHEAD

        {"open": AHEAD.start, "quiet": AHEAD.quiet}[phase]()
    busy, start = (_cpu_seconds(), time.monotonic()) if CPU_LOG else (0.0, 0.0)
    with harness.SUITE_LOCK.hold(exclusive=item.get_closest_marker("alone") is not None):
        yield
    if CPU_LOG:  # a line per test: the machine's CPU-seconds and the seconds it ran (a module fixture: its first test)
        line = {
            "test": item.nodeid,
            "cpu_s": round(_cpu_seconds() - busy, 1),
            "wall_s": round(time.monotonic() - start, 1),
        }
        with open(CPU_LOG, "a") as log:
            log.write(json.dumps(line) + "\n")


# CUBOID_TEST_CPU_LOG=FILE: where the suite's CPU goes (run it alone, on one worker: the machine's busy time is
# charged to the test running).
CPU_LOG = os.environ.get("CUBOID_TEST_CPU_LOG")


def _cpu_seconds() -> float:
    """CPU-seconds the whole machine has been busy (every core; /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _seen() -> dict:
    """What this process recorded for the session's summary: tests/harness.py's spec times and fresh interpreters,
    the SLURM commands its decoys caught, test_parity's tables."""
    harness, parity = sys.modules.get("harness"), sys.modules.get("test_parity")
    return {
        "spec_times": list(getattr(harness, "SPEC_TIMES", [])),
        "fallbacks": list(getattr(harness, "FALLBACKS", [])),
        "slurm_calls": DECOY_LOG.read_text() if DECOY_LOG.exists() else "",
        "parity": dict(getattr(parity, "PARITY_TABLE", {})),
        "planner": dict(getattr(parity, "PLANNER_TABLE", {})),
        "fit": dict(getattr(parity, "FIT_TABLE", {})),
    }


_FROM_WORKERS: list[dict] = []  # under pytest -n N, in the controller: what each worker recorded (_seen)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    seen = getattr(node, "workeroutput", {}).get("cuboid")
    if seen:
        _FROM_WORKERS.append(json.loads(seen))


def _session_seen() -> dict:
    merged = _seen()
    for seen in _FROM_WORKERS:
        for key, value in seen.items():
            if isinstance(value, dict):
                merged[key].update(value)
            else:
                merged[key] += value
    return merged


def pytest_sessionfinish(session, exitstatus) -> None:
    """A call that reached a SLURM command fails the run, naming it (a worker hands what it saw to the controller)."""
    if hasattr(session.config, "workerinput"):
        session.config.workeroutput["cuboid"] = json.dumps(_seen())
        return
    calls = _session_seen()["slurm_calls"].strip()
    if calls:
        session.config._cuboid_slurm_calls = calls
        session.exitstatus = 1


def pytest_unconfigure(config) -> None:
    harness = sys.modules.get("harness")
    if harness is not None:  # the fork server of the multi-process launches, and every process it started
        harness.FORKSERVER.stop()
    shutil.rmtree(_DECOYS, ignore_errors=True)  # the decoys' directory goes with the session


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Print the slowest specs, the python runs not forked, any SLURM command a test reached, and the parity,
    planner and fit tables when the parity tests ran (from every worker under pytest -n N)."""
    seen = _session_seen()
    write = terminalreporter.write_line
    if seen["spec_times"]:
        total = sum(t for t, *_ in seen["spec_times"])
        terminalreporter.section(f"slowest specs ({len(seen['spec_times'])} specs, {total:.0f} s on rank 0 in all)")
        for seconds, ranks, name, script in sorted(seen["spec_times"], reverse=True)[:25]:
            write(f"{seconds:7.1f} s  {ranks} ranks  {name}  ({script})")
    ahead = sys.modules.get("ahead")
    if ahead is not None and ahead.AHEAD.seconds:
        done = ahead.AHEAD.seconds
        terminalreporter.section(
            f"{len(done)} module fixtures ran ahead of their modules (tests/ahead.py), in this order"
        )
        for key, seconds in done.items():
            write(f"{seconds:7.1f} s  {key}")
    if seen["fallbacks"]:
        terminalreporter.section(f"{len(seen['fallbacks'])} python runs not forked (a fresh interpreter each)")
        for why, cmd in seen["fallbacks"]:
            write(f"{why}: {cmd}")
    calls = getattr(config, "_cuboid_slurm_calls", None)
    if calls:
        terminalreporter.section("SLURM commands reached during the suite (the run fails)")
        write(calls)
    if not seen["parity"]:
        return
    terminalreporter.section("parity vs single-process fp32 (bound: loss rel 1e-5, params abs 1e-5)")
    write(f"{'layout':50s} {'max rel loss err':>18s} {'max abs param err':>18s}")
    for name, (loss_err, param_err) in seen["parity"].items():
        write(f"{name:50s} {loss_err:18.2e} {param_err:18.2e}")
    if seen["planner"]:
        terminalreporter.section("planner persistent bytes vs measured (bound: 10%)")
        write(f"{'layout':50s} {'worst |est/meas - 1|':>20s} {'measured B/rank':>16s}")
        for name, (worst, measured) in seen["planner"].items():
            write(f"{name:50s} {worst:20.2%} {measured:16.0f}")
    if seen["fit"]:
        terminalreporter.section("cuboid.measure's parameter bytes estimated before sharding vs measured (bound: 10%)")
        for name, worst in seen["fit"].items():
            write(f"{name:50s} {worst:20.2%}")
