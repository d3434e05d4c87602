"""Expert parallel: the experts of every mixture-of-experts layer split over ranks, each chosen
(token, expert) pair sent to the rank holding its expert and back (all-to-alls with uneven splits), the router
left as the model defines it, its load-balancing loss summed over the step's ranks (``balance``), and, asked for,
a per-expert bias on the router's choice that balances the load without a loss (``bias``)."""

from cuboid.experts.balance import LoadBalancing, check_router_loss_model, router_loss_model, settle_block_losses
from cuboid.experts.balance import active as active_balancing
from cuboid.experts.balance import loss_of as balancing_loss
from cuboid.experts.balance import statistics as balancing_statistics
from cuboid.experts.bias import ExpertBias, ExpertBiasError, find_routers
from cuboid.experts.dispatch import ExpertParallelError, RoutingReplay, combine, dispatch, expert_block
from cuboid.experts.hf import distribute_experts, experts_modules, grouped_mm_runs, shard_experts
from cuboid.experts.load import ExpertLoad, load_figures

__all__ = [
    "ExpertBias",
    "ExpertBiasError",
    "ExpertLoad",
    "ExpertParallelError",
    "LoadBalancing",
    "RoutingReplay",
    "active_balancing",
    "balancing_loss",
    "balancing_statistics",
    "check_router_loss_model",
    "combine",
    "dispatch",
    "distribute_experts",
    "expert_block",
    "experts_modules",
    "find_routers",
    "grouped_mm_runs",
    "load_figures",
    "router_loss_model",
    "settle_block_losses",
    "shard_experts",
]
