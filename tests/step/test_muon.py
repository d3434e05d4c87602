"""Muon across shards (``cuboid.step.muon``) in one process: the iteration is torch's, Cuboid's Muon steps as
torch's does (its step hooks once), a matrix sharded over a one-rank mesh comes back as the function of the whole,
and a refusal of a parameter that is not a matrix names it. The layouts (dp2, tp2, dp2 x tp2) and the ledger's
bytes are in ``tests/parallel/test_parity.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cuboid import compat
from cuboid.optim import Muon, MuonError, newton_schulz, whole_matrices
from cuboid.step import refuse_muon_shapes


@pytest.mark.parametrize("shape", [(8, 5), (5, 8)])
def test_the_iteration_is_torchs_in_bfloat16_and_near_it_in_fp32(shape: tuple[int, int]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    torch_own = compat.muon_newton_schulz.original(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(newton_schulz(g), torch_own)
    fp32 = newton_schulz(g, dtype=torch.float32)
    assert fp32.dtype == torch.float32 and (fp32 - torch_own.float()).abs().max() < 0.05  # bf16's rounding apart


def test_cuboids_muon_steps_as_torchs_and_runs_its_step_hooks_once() -> None:
    torch.manual_seed(0)
    mine, theirs = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6, 4))
    with torch.no_grad():
        theirs.copy_(mine)
    torch_opt, opt = torch.optim.Muon([theirs], lr=0.1), Muon([mine], lr=0.1)  # torch's class hooked first
    hooks = []
    opt.register_step_post_hook(lambda *_: hooks.append(1))
    for _ in range(3):
        g = torch.randn(6, 4)
        mine.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    assert torch.equal(mine, theirs) and hooks == [1, 1, 1]


def test_a_sharded_matrix_is_orthogonalized_whole(tmp_path: Path) -> None:
    """On a one-rank gloo group: a DTensor matrix goes through the gather and scatter and comes back as the function
    of the whole matrix, with its placements; the function saw the whole shape; a plain tensor passes straight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        whole = torch.randn(7, 3)
        seen = []

        @whole_matrices
        def orthogonalize(x: torch.Tensor) -> torch.Tensor:
            seen.append((type(x).__name__, tuple(x.shape)))
            return newton_schulz(x, dtype=torch.float32)

        out = orthogonalize(distribute_tensor(whole, mesh, [Shard(0)]))
        assert seen == [("Tensor", (7, 3))] and out.placements == (Shard(0),)
        torch.testing.assert_close(out.full_tensor(), newton_schulz(whole, dtype=torch.float32), rtol=0, atol=0)
        assert torch.equal(orthogonalize(whole), newton_schulz(whole, dtype=torch.float32))
    finally:
        dist.destroy_process_group()


def test_a_parameter_that_is_not_a_matrix_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with pytest.raises(ValueError, match="Muon only supports 2D parameters") as caught:
        torch.optim.Muon(model.parameters())
    error = refuse_muon_shapes(caught.value, model.named_parameters())
    assert isinstance(error, MuonError)
    assert "0.bias, 1.weight, 1.bias (torch.Size([4]))" in str(error) and "AdamW" in str(error)
    other = ValueError("something else")
    assert refuse_muon_shapes(other, model.named_parameters()) is other
