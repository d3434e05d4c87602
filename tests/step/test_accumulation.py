"""cuboid.step.accumulation: what waits for the optimizer step's last microbatch while gradients accumulate. In one
process on a 1 x 1 HSDP mesh (which takes HSDP's code path: reduce-scatter, then all-reduce across replicas); the
4-rank runs are tests/parallel/test_parity.py's hsdp2x2-accum specs and its ledger test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cuboid.step import DeferredReductions


class TwoUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, skip_second: bool = False) -> torch.Tensor:
        h = self.first(x)
        return h.sum(-1, keepdim=True) if skip_second else self.second(h)


@pytest.fixture
def hsdp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    finally:
        if started:
            dist.destroy_process_group()


def _sharded(mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TwoUnits()
    fully_shard(model.first, mesh=mesh)
    fully_shard(model.second, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@pytest.mark.parametrize("mode", ["replicas", "all"])
def test_deferred_gradients_equal_reducing_every_microbatch(hsdp_mesh, mode: str) -> None:
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    grads = {}
    for name, how in (("every", None), ("deferred", mode)):
        model, deferred = _sharded(hsdp_mesh), DeferredReductions(how, hsdp=True)
        for x in batches[:-1]:
            with deferred.accumulating(model):
                model(x).sum().backward()
        model(batches[-1]).sum().backward()
        deferred.check_reduced(model)
        grads[name] = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    assert all(torch.allclose(grads["every"][k], grads["deferred"][k], atol=1e-6) for k in grads["every"])


def test_a_unit_without_gradients_on_the_last_microbatch_is_refused_by_name(hsdp_mesh) -> None:
    model, deferred = _sharded(hsdp_mesh), DeferredReductions("replicas", hsdp=True)
    with deferred.accumulating(model):
        model(torch.randn(3, 4)).sum().backward()
    assert deferred.pending
    model(torch.randn(3, 4), skip_second=True).sum().backward()  # second gets no gradient on the last microbatch
    with pytest.raises(RuntimeError, match=r"defer_reductions='replicas': second got gradients on earlier"):
        deferred.check_reduced(model)


def test_nothing_is_deferred_where_nothing_would_be_saved() -> None:
    """Plain FSDP has no all-reduce to defer ("replicas" leaves it alone); under pipeline parallel torch's schedule
    sets the flags itself; ``None`` defers nothing; a bad mode is refused with the choices."""
    model = nn.Linear(2, 2)
    for mode, hsdp, pipelined in (("replicas", False, False), ("all", True, True), (None, True, False)):
        deferred = DeferredReductions(mode, hsdp=hsdp, pipelined=pipelined)
        with deferred.accumulating(model):
            pass
        assert not deferred.pending
    with pytest.raises(ValueError, match=r"defer_reductions='sometimes': choose 'replicas'"):
        DeferredReductions("sometimes")
