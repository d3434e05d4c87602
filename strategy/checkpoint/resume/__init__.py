"""Resuming mid-epoch: where the data stands (:mod:`~cuboid.checkpoint.resume.data_position`: the
:class:`DataPosition` a checkpointer holds, what a save records of the data and how a load plans the next train
loader) and the train loaders a resume hands Lightning (:mod:`~cuboid.checkpoint.resume.loaders`). Every name the
module ``cuboid.checkpoint.resume`` had is here still."""

from cuboid.checkpoint.resume.data_position import (
    DATA_POSITIONS,
    DataPosition,
    check_position,
    fit_loop_state,
    gather_loader_states,
    plan_resume,
    position,
    refuse_other_degree,
    save_position,
)
from cuboid.checkpoint.resume.loaders import (
    RestartedEpoch,
    ResumedLoader,
    SkipFirstBatches,
    TailSampler,
    TrackedLoader,
    batching,
    deal_as_dataloader,
    distributed_sampler,
    epoch_order,
    keeps_state,
    restored_names,
)

__all__ = [
    "DATA_POSITIONS",
    "DataPosition",
    "RestartedEpoch",
    "ResumedLoader",
    "SkipFirstBatches",
    "TailSampler",
    "TrackedLoader",
    "batching",
    "check_position",
    "deal_as_dataloader",
    "distributed_sampler",
    "epoch_order",
    "fit_loop_state",
    "gather_loader_states",
    "keeps_state",
    "plan_resume",
    "position",
    "refuse_other_degree",
    "restored_names",
    "save_position",
]
