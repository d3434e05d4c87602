"""pytest hooks only; the helpers tests use live in harness.py."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

# SLURM's commands, shadowed for the whole session by decoys: a call that carries the suite's own cluster's
# SLURM_CONF (tests/job/test_local_cluster.py brings it up, scripts/slurm/local_cluster.sh) goes to the real command;
# any other is recorded and fails (tests that simulate SLURM with its variables must never reach a real controller:
# on a cluster's login node job 4242 may be someone's).
SLURM_COMMANDS = ("sbatch", "srun", "scancel", "scontrol", "squeue", "sacct", "sinfo")
PRIVATE_CONF_VAR = "CUBOID_TEST_SLURM_CONF"  # set by the local-cluster fixture to its slurm.conf
_DECOYS = Path(tempfile.mkdtemp(prefix="cuboid-slurm-decoys-"))
DECOY_LOG = _DECOYS / "calls.log"


def pytest_configure(config) -> None:
    # The suite's own interpreter first: what the tests start as `python` (SLURM jobs, Lightning's launcher, shell
    # scripts) is the interpreter running the suite, also from a virtual environment that was not activated.
    here = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
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


def pytest_collection_modifyitems(config, items) -> None:
    """The quick tier (``-m quick``): every test not marked slow joins it; a slow one joins by its own mark."""
    import pytest

    for item in items:
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


def pytest_sessionfinish(session, exitstatus) -> None:
    """A call that reached a SLURM command fails the run, naming it."""
    if DECOY_LOG.exists() and DECOY_LOG.read_text().strip():
        session.config._cuboid_slurm_calls = DECOY_LOG.read_text()
        session.exitstatus = 1


def pytest_unconfigure(config) -> None:
    harness = sys.modules.get("harness")
    if harness is not None:  # the fork server of the multi-process launches, and every process it started
        harness.FORKSERVER.stop()
    shutil.rmtree(_DECOYS, ignore_errors=True)  # the decoys' directory goes with the session


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Print the parity table (layout -> measured errors) when the parity tests ran, and any SLURM command a test
    reached."""
    harness = sys.modules.get("harness")
    if harness is not None and harness.SPEC_TIMES:
        total = sum(t for t, *_ in harness.SPEC_TIMES)
        terminalreporter.section(f"slowest specs ({len(harness.SPEC_TIMES)} specs, {total:.0f} s on rank 0 in all)")
        for seconds, ranks, name, script in sorted(harness.SPEC_TIMES, reverse=True)[:25]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {ranks} ranks  {name}  ({script})")
    if harness is not None and harness.FALLBACKS:
        terminalreporter.section(f"{len(harness.FALLBACKS)} python runs not forked (a fresh interpreter each)")
        for why, cmd in harness.FALLBACKS:
            terminalreporter.write_line(f"{why}: {cmd}")
    calls = getattr(config, "_cuboid_slurm_calls", None)
    if calls:
        terminalreporter.section("SLURM commands reached during the suite (the run fails)")
        terminalreporter.write_line(calls)
    table = getattr(sys.modules.get("test_parity"), "PARITY_TABLE", None)
    if not table:
        return
    terminalreporter.section("parity vs single-process fp32 (bound: loss rel 1e-5, params abs 1e-5)")
    terminalreporter.write_line(f"{'layout':50s} {'max rel loss err':>18s} {'max abs param err':>18s}")
    for name, (loss_err, param_err) in table.items():
        terminalreporter.write_line(f"{name:50s} {loss_err:18.2e} {param_err:18.2e}")
    planner = getattr(sys.modules.get("test_parity"), "PLANNER_TABLE", None)
    if planner:
        terminalreporter.section("planner persistent bytes vs measured (bound: 10%)")
        terminalreporter.write_line(f"{'layout':50s} {'worst |est/meas - 1|':>20s} {'measured B/rank':>16s}")
        for name, (worst, measured) in planner.items():
            terminalreporter.write_line(f"{name:50s} {worst:20.2%} {measured:16.0f}")
    fit = getattr(sys.modules.get("test_parity"), "FIT_TABLE", None)
    if fit:
        terminalreporter.section(
            "cuboid.planning.capacity parameter bytes estimated before sharding vs measured (bound: 10%)"
        )
        for name, worst in fit.items():
            terminalreporter.write_line(f"{name:50s} {worst:20.2%}")
