"""What a run holds and sends, measured while it runs: setup's fit check (the parameter and optimizer bytes each rank
will hold, counted from the unsharded model and compared with the device before anything is allocated) and the
communication ledger (:class:`CommLedger`, a callback that counts each optimizer step's collectives per mesh
dimension). The offline planner's formulas are in :mod:`cuboid.planning`."""

from cuboid.measure.capacity import (
    Estimate,
    check_fits,
    device_bytes,
    estimate,
    held_bytes,
    local_nbytes,
    refuse_if_too_big,
)
from cuboid.measure.ledger import CommLedger, hand_to_ledgers

__all__ = [
    "CommLedger",
    "Estimate",
    "check_fits",
    "device_bytes",
    "estimate",
    "hand_to_ledgers",
    "held_bytes",
    "local_nbytes",
    "refuse_if_too_big",
]
