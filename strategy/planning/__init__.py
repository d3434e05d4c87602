"""Knowing before launching: the layout planner and its formulas (memory, step time, and the bytes each collective
should move: :func:`expected`), its command line, and the dry run on fake ranks. What a run measures while it runs
(setup's fit check, the communication ledger) is in :mod:`cuboid.measure`."""

from cuboid.planning.at_setup import Planned, device_of, plan_module
from cuboid.planning.cli import main as planner_main
from cuboid.planning.comm import expected
from cuboid.planning.dryrun import dry_run
from cuboid.planning.dryrun import main as dry_run_main
from cuboid.planning.measured import Profile, Unmeasured, first_batch, profile
from cuboid.planning.planner import plan
from cuboid.planning.shapes import GPUS, Hardware, Setup, Shape

__all__ = [
    "GPUS",
    "Hardware",
    "Planned",
    "Profile",
    "Unmeasured",
    "Setup",
    "Shape",
    "device_of",
    "dry_run",
    "dry_run_main",
    "expected",
    "first_batch",
    "plan",
    "plan_module",
    "planner_main",
    "profile",
]
