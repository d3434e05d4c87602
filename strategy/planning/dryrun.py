"""Plan a layout without the hardware: ``python -m cuboid.dryrun --model 70b --dp 8 --tp 8``.

The LightningModule is built on the meta device and parallelized exactly as :class:`~cuboid.CuboidStrategy`
would (tensor-parallel plan checked against the sizes, FSDP2 per block) inside one process that stands in for
every rank through torch's fake process group, so nothing is allocated: the plan is checked and each rank's
persistent bytes (parameters, gradients, AdamW state) are read from the local shapes of the sharded
parameters. Pipeline parallelism is not simulated here (``pp = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from cuboid import compat
from cuboid.parallel import plans
from cuboid.parallel.build import ParallelSettings, parallelize_plain
from cuboid.parallel.mesh import Layout, LayoutError, build_device_mesh


@dataclass
class RankBytes:
    """Persistent bytes on one rank (the largest share, rank 0's under even sharding), fp32 AdamW training."""

    world: int
    params: int
    elements: int
    total_elements: int

    @property
    def grads(self) -> int:
        return self.params

    @property
    def optimizer(self) -> int:
        return 2 * self.params  # AdamW: exp_avg and exp_avg_sq, like the parameters

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def dry_run(lm: nn.Module, layout: Layout, tensor_parallel_plan: dict[str, str] | None = None) -> RankBytes:
    """Parallelize ``lm`` (built on meta by its ``configure_model``) for ``layout`` on fake ranks; report rank 0's
    persistent bytes. Raises the same plan errors as the strategy (e.g. heads not divisible by ``tp``)."""
    if not isinstance(layout.dp_shard, int):
        raise LayoutError("dry_run needs every size given: data_parallel_shard is 'auto'.")
    layout = layout.resolve(layout.pp * layout.dp_replicate * layout.dp_shard * layout.tp)
    if layout.pp != 1:
        raise LayoutError("dry_run does not simulate pipeline stages: use pipeline_parallel=1.")
    world = layout.pp * layout.dp * layout.tp
    owns_group = not dist.is_initialized()
    if owns_group:
        compat.init_fake_process_group(world)
    try:
        if callable(getattr(lm, "configure_model", None)):
            lm.configure_model()
        if any(not t.is_meta for t in lm.parameters()):
            raise ValueError("dry_run needs the model built on the meta device (e.g. CausalLM(meta_init=True)).")
        mesh, _ = build_device_mesh(layout, "cpu")
        matched = plans.resolve_plan(lm, tensor_parallel_plan, layout.tp)
        blocks = plans.find_blocks(lm, None)
        parallelize_plain(lm, blocks, matched, ParallelSettings.on(mesh, mp_policy=MixedPrecisionPolicy()))
        local = [p.to_local() if isinstance(p, DTensor) else p for p in lm.parameters()]
        assert all(t.is_meta for t in local), "dry_run allocated a tensor"
        return RankBytes(
            world=world,
            params=sum(t.numel() * t.element_size() for t in local),
            elements=sum(t.numel() for t in local),
            total_elements=sum(p.numel() for p in lm.parameters()),
        )
    finally:
        if owns_group:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import argparse

    from cuboid.models import CausalLM

    parser = argparse.ArgumentParser(prog="python -m cuboid.dryrun", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="8b", help="a named size of cuboid.models (debug, 150m, 1b, 3b, 8b, 70b)")
    parser.add_argument("--dp", type=int, default=8, help="data_parallel_shard")
    parser.add_argument("--replicate", type=int, default=1, help="data_parallel_replicate")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel")
    args = parser.parse_args(argv)
    report = dry_run(CausalLM(model=args.model, meta_init=True), Layout(1, args.replicate, args.dp, args.tp))
    gib = 2**30
    print(
        f"{args.model} on dp_replicate={args.replicate} x dp_shard={args.dp} x tp={args.tp} ({report.world} ranks): "
        f"{report.total_elements / 1e9:.2f}B parameters, {report.elements / 1e9:.3f}B on rank 0; fp32 AdamW "
        f"persistent bytes per rank: params {report.params / gib:.2f} GiB, grads {report.grads / gib:.2f} GiB, "
        f"optimizer {report.optimizer / gib:.2f} GiB, total {report.total / gib:.2f} GiB (activations not included)"
    )
