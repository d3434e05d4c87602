"""The suite is safe on a cluster's login node: SLURM's commands are decoys for the whole session (conftest), so a
test that simulates SLURM with its variables cannot requeue, cancel or submit anything on a real controller; any
call fails the run, naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import DECOY_LOG, SLURM_COMMANDS


def test_slurm_commands_are_the_sessions_decoys() -> None:
    for name in SLURM_COMMANDS:
        found = shutil.which(name)
        assert found is not None and Path(found).parent == DECOY_LOG.parent, (name, found)


def test_no_test_has_reached_a_slurm_command_so_far() -> None:
    assert not DECOY_LOG.exists() or not DECOY_LOG.read_text().strip(), DECOY_LOG.read_text()


def test_python_on_the_path_is_the_suites_interpreter() -> None:
    """SLURM jobs and scripts the tests start run ``python`` from the PATH: the suite's own interpreter comes first,
    so a suite run as ``.venv/bin/python -m pytest`` (the venv not activated) starts its jobs in that venv."""
    import os
    import sys

    found = shutil.which("python")
    assert found is not None and Path(found).parent == Path(sys.executable).parent, (found, sys.executable)
    assert os.environ["PATH"].split(os.pathsep)[1] == os.path.dirname(sys.executable)
