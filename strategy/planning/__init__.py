"""Knowing before launching: the layout planner and its formulas, setup's fit check
(:mod:`cuboid.planning.capacity`), the dry run on fake ranks, and the communication ledger."""

from cuboid.planning.capacity import Estimate, check_fits, device_bytes, held_bytes, local_nbytes, refuse_if_too_big
from cuboid.planning.capacity import estimate as estimate_fit
from cuboid.planning.cli import main as planner_main
from cuboid.planning.dryrun import dry_run
from cuboid.planning.dryrun import main as dry_run_main
from cuboid.planning.ledger import CommLedger, expected
from cuboid.planning.planner import plan
from cuboid.planning.shapes import GPUS, Hardware, Setup, Shape

__all__ = [
    "CommLedger",
    "Estimate",
    "GPUS",
    "Hardware",
    "Setup",
    "Shape",
    "check_fits",
    "device_bytes",
    "dry_run",
    "dry_run_main",
    "estimate_fit",
    "expected",
    "held_bytes",
    "local_nbytes",
    "plan",
    "planner_main",
    "refuse_if_too_big",
]
