"""The planning wing: knowing before launching. The layout planner and its formulas, setup's fit check
(:mod:`cuboid.planning.capacity`), the dry run on fake ranks, and the communication ledger."""

from cuboid.planning.capacity import check_fits, held_bytes, local_nbytes
from cuboid.planning.dryrun import dry_run
from cuboid.planning.ledger import CommLedger, expected
from cuboid.planning.planner import plan
from cuboid.planning.shapes import GPUS, Hardware, Setup, Shape

__all__ = [
    "GPUS",
    "CommLedger",
    "Hardware",
    "Setup",
    "Shape",
    "check_fits",
    "dry_run",
    "expected",
    "held_bytes",
    "local_nbytes",
    "plan",
]
