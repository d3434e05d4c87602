"""Plan a layout without the hardware: ``python -m cuboid.dryrun --model 70b --dp 8 --tp 8``.

The LightningModule is built on the meta device and parallelized exactly as :class:`~cuboid.CuboidStrategy`
would (tensor-parallel plan checked against the sizes, FSDP2 per block) inside one process that stands in for
every rank through torch's fake process group, so nothing is allocated: the plan is checked and each rank's
persistent bytes (parameters, gradients, AdamW state) are read from the local shapes of the sharded
parameters. Under pipeline parallelism (``pp > 1``) the stages are not built on fake ranks: each pp rank's bytes are
counted from the model's own split (:func:`cuboid.measure.estimate`, the count setup's fit check uses,
equal to the measured shards on every pipeline parity layout), for Cuboid's models and Hugging Face decoders alike.

    python -m cuboid.dryrun --model 70b --dp 8 --tp 8
    python -m cuboid.dryrun --hf-config path/to/config.json --pp 4 --dp 4 --tp 8
    python -m cuboid.dryrun --hf-config path/to/qwen3_moe/config.json --dp 8 --ep 8   # experts split over 8 ranks
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from cuboid import compat
from cuboid.parallel import (
    BuildSettings,
    Layout,
    LayoutError,
    ParallelDims,
    ParallelSettings,
    find_blocks,
    parallelize_plain,
    resolve_plan,
    with_loss_parallel,
)


@dataclass
class RankBytes:
    """Persistent bytes on one rank (the largest share, rank 0's under even sharding), fp32 AdamW training."""

    world: int
    params: int
    elements: int
    total_elements: int
    per_pp_rank: list[int] | None = None  # under pp: each pp rank's parameter bytes (params is the largest)
    experts: tuple[int, int] | None = None  # under ep: (experts this rank computes per MoE layer, of how many)

    @property
    def grads(self) -> int:
        return self.params

    @property
    def optimizer(self) -> int:
        return 2 * self.params  # AdamW: exp_avg and exp_avg_sq, like the parameters

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def dry_run(
    lm: nn.Module,
    layout: Layout,
    tensor_parallel_plan: dict[str, str] | None = None,
    pipeline_schedule: str = "1F1B",
    virtual_stages: int | None = None,
) -> RankBytes:
    """Parallelize ``lm`` (built on meta by its ``configure_model``) for ``layout`` on fake ranks; report rank 0's
    persistent bytes (under pp: the largest pp rank's, and each pp rank's). Raises the same plan and pipeline errors
    as the strategy (e.g. heads not divisible by ``tp``, a model that cannot be cut into stages)."""
    if not isinstance(layout.dp_shard, int):
        raise LayoutError("dry_run needs every size given: data_parallel_shard is 'auto'.")
    layout = layout.resolve(layout.pp * layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp)
    world = layout.pp * layout.dp * layout.cp * layout.tp
    if layout.pp != 1:
        return _pipeline_dry_run(lm, layout, tensor_parallel_plan, pipeline_schedule, virtual_stages)
    owns_group = not dist.is_initialized()
    if owns_group:
        compat.init_fake_process_group(world)
    try:
        if callable(getattr(lm, "configure_model", None)):
            lm.configure_model()
        if any(not t.is_meta for t in lm.parameters()):
            raise ValueError("dry_run needs the model built on the meta device (e.g. CausalLM(meta_init=True)).")
        dims = ParallelDims(layout)
        dims.build("cpu")
        matched = resolve_plan(lm, tensor_parallel_plan, layout.tp)
        blocks = find_blocks(lm, None)
        experts = dims.experts
        settings = ParallelSettings.on(dims.mesh, BuildSettings(layout=layout), MixedPrecisionPolicy(), experts)
        parallelize_plain(lm, blocks, matched, settings)
        local = [p.to_local() if isinstance(p, DTensor) else p for p in lm.parameters()]
        assert all(t.is_meta for t in local), "dry_run allocated a tensor"
        return RankBytes(
            world=world,
            params=sum(t.numel() * t.element_size() for t in local),
            elements=sum(t.numel() for t in local),
            total_elements=sum(p.numel() for p in lm.parameters()),
            experts=_experts_per_rank(lm) if experts is not None else None,
        )
    finally:
        if owns_group:
            dist.destroy_process_group()


def _experts_per_rank(lm: nn.Module) -> tuple[int, int]:
    """(experts one rank computes, experts) of the first MoE layer: the ep split of its packed parameters."""
    from cuboid.experts import experts_modules

    _, module = next(experts_modules(lm))
    param = next(p for n, p in module.named_parameters() if n in ("gate_up_proj", "up_proj"))
    ep_dim = param.device_mesh.mesh_dim_names.index("ep")
    return param.shape[0] // param.device_mesh.size(ep_dim), module.num_experts


def _pipeline_dry_run(
    lm: nn.Module, layout: Layout, plan: dict[str, str] | None, schedule: str, virtual_stages: int | None
) -> RankBytes:
    from cuboid.measure import estimate
    from cuboid.pipeline import Pipelining

    if callable(getattr(lm, "configure_model", None)):
        lm.configure_model()
    matched, _ = with_loss_parallel(resolve_plan(lm, plan, layout.tp), layout.pp, layout.cp)
    blocks = find_blocks(lm, None)
    pipelining = Pipelining(layout, schedule, virtual_stages=virtual_stages)
    per_rank = estimate(lm, layout, matched, blocks, pipelining).per_pp_rank
    elements = estimate(lm, layout, matched, blocks, pipelining, param_bytes=1).per_pp_rank
    worst = max(range(layout.pp), key=per_rank.__getitem__)
    total = sum(p.numel() for p in lm.parameters())
    world = layout.pp * layout.dp * layout.cp * layout.tp
    return RankBytes(world, per_rank[worst], elements[worst], total, per_pp_rank=per_rank)


def _hf_module(config_path: str) -> nn.Module:
    """A LightningModule holding a transformers model built on meta from ``config_path`` (a config.json or its
    directory), as a user's would."""
    import lightning as L
    import transformers

    class HFModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.model = transformers.AutoModelForCausalLM.from_config(
                    transformers.AutoConfig.from_pretrained(config_path)
                )

    return HFModel()


def main(argv: list[str] | None = None) -> None:
    import argparse

    from cuboid.models import CausalLM

    parser = argparse.ArgumentParser(prog="python -m cuboid.dryrun", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="8b", help="a named size of cuboid.models (debug, moe_debug, 150m, 1b, 3b, 8b, 70b)"
    )
    parser.add_argument("--hf-config", default=None, help="a transformers config.json (or its directory) instead")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_parallel")
    parser.add_argument("--schedule", default="1F1B", help="pipeline_schedule (under --pp)")
    parser.add_argument("--dp", type=int, default=8, help="data_parallel_shard")
    parser.add_argument("--replicate", type=int, default=1, help="data_parallel_replicate")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel")
    parser.add_argument("--cp", type=int, default=1, help="context_parallel (FSDP shards over dp_shard x cp)")
    parser.add_argument("--ep", type=int, default=1, help="expert_parallel (MoE experts over ep of the dp_shard ranks)")
    args = parser.parse_args(argv)
    lm = _hf_module(args.hf_config) if args.hf_config else CausalLM(model=args.model, meta_init=True)
    layout = Layout(pp=args.pp, dp_replicate=args.replicate, dp_shard=args.dp, cp=args.cp, tp=args.tp, ep=args.ep)
    report = dry_run(lm, layout, pipeline_schedule=args.schedule)
    gib = 2**30
    name = args.hf_config or args.model
    print(
        f"{name} on {layout.describe()} "
        f"({report.world} ranks): "
        f"{report.total_elements / 1e9:.2f}B parameters, {report.elements / 1e9:.3f}B on the fullest rank; fp32 AdamW "
        f"persistent bytes per rank: params {report.params / gib:.2f} GiB, grads {report.grads / gib:.2f} GiB, "
        f"optimizer {report.optimizer / gib:.2f} GiB, total {report.total / gib:.2f} GiB (activations not included)"
    )
    if report.experts:
        held, of = report.experts
        print(f"  experts: {held} of {of} per MoE layer computed on each rank (gathered over "
              f"efsdp={layout.dp_shard * layout.cp // layout.ep}); their shards are in the bytes above")  # fmt: skip
    for rank, nbytes in enumerate(report.per_pp_rank or []):
        print(f"  pp rank {rank}: params {nbytes / gib:.3f} GiB, with grads and AdamW {4 * nbytes / gib:.3f} GiB")
