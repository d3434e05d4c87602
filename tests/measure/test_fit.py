"""cuboid.measure (setup's fit check): the per-rank parameter bytes the strategy counts from the unsharded model before sharding, and the
refusals built on them (the multi-process checks run in test_parity and test_third_party: the estimate against each
rank's measured shards on every layout, and the refusal of a layout too big for a device, before anything is
allocated)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cuboid.measure import check_fits, estimate, refuse_if_too_big
from cuboid.models import Llama, LlamaConfig
from cuboid.parallel.mesh import Layout, LayoutError
from cuboid.parallel.plans import find_blocks, resolve_plan
from cuboid.pipeline.pipelining import Pipelining
from cuboid.planning.estimate import Setup, Shape, rank_memory

CFG = LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64)


class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.model = Llama(CFG)


@pytest.mark.parametrize(
    ("pp", "rep", "shard", "tp", "schedule"),
    [(1, 1, 1, 1, "1F1B"), (1, 1, 8, 1, "1F1B"), (1, 2, 2, 2, "1F1B"), (2, 1, 2, 2, "1F1B"),
     (2, 1, 1, 1, "Interleaved1F1B"), (4, 1, 1, 2, "1F1B")],
)  # fmt: skip
def test_estimate_from_the_module_agrees_with_the_planners_formula(pp, rep, shard, tp, schedule) -> None:
    """Two independent counts of one rank's parameter bytes: cuboid.measure.estimate walks the module's parameters (on meta) with
    its tp plan and pipeline split; cuboid.planning.estimate multiplies Llama's shape. They agree to FSDP's chunk rounding."""
    lm = _Module()
    layout = Layout(pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp).resolve(pp * rep * shard * tp)
    pipelining = Pipelining(layout, schedule)
    est = estimate(lm, layout, resolve_plan(lm, None, tp), find_blocks(lm), pipelining)
    setup = Setup(pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp, precision="32-true", schedule=schedule,
                  virtual_stages=pipelining.virtual_stages)  # fmt: skip
    assert len(est.per_pp_rank) == pp
    for rank in range(pp):
        formula = rank_memory(Shape.of(CFG), setup, rank).params
        assert est.rank_bytes(rank) == pytest.approx(formula, rel=0.01), rank
        assert all(p.is_meta for p in lm.parameters())  # counting allocates nothing


def test_estimate_counts_the_converted_dtype_and_stray_parameters_whole() -> None:
    lm = _Module()
    lm.scale = nn.Parameter(torch.ones(1000, device="meta"))  # the LightningModule's own: outside every FSDP unit
    layout = Layout(dp_shard=4).resolve(4)
    full = estimate(lm, layout, {}, find_blocks(lm), Pipelining(Layout()))
    half = estimate(lm, layout, {}, find_blocks(lm), Pipelining(Layout()), param_bytes=2)
    assert half.rank_bytes(0) * 2 == full.rank_bytes(0)
    without = sum(p.numel() for n, p in lm.named_parameters() if n != "scale") * 4 / 4
    assert full.rank_bytes(0) == pytest.approx(without + 4000, rel=0.01)


def test_refusal_names_the_estimate_auto_and_the_shard_group_it_would_take() -> None:
    lm = _Module()
    layout = Layout(dp_shard=2, tp=2).resolve(4)
    est = estimate(lm, layout, resolve_plan(lm, None, 2), find_blocks(lm), Pipelining(Layout()))
    params = est.rank_bytes(0)
    refuse_if_too_big(est, layout, 2 * params, auto=True)  # parameters + gradients fit exactly: not refused
    with pytest.raises(LayoutError) as err:
        refuse_if_too_big(est, layout, 2 * params - 1, auto=True)
    text = str(err.value)
    assert text.startswith("The layout pp=1 x dp_replicate=1 x dp_shard=2 x tp=2 cannot fit: each rank would hold")
    assert "data_parallel_shard='auto' filled 2 (the world 4 / (pipeline_parallel x data_parallel_replicate x " in text
    assert "Parameters and gradients alone need data_parallel_shard >= 3 (6 GPUs" in text
    assert "with Adam >= 5 (10 GPUs)" in text and "cpu_offload=True" in text and "Nothing was allocated" in text
    with pytest.raises(LayoutError) as err:
        refuse_if_too_big(est, layout, params, auto=False)
    assert "auto" not in str(err.value)


def test_check_fits_with_the_optimizers_state() -> None:
    """The check the strategy runs on a GPU after setting up the optimizers (the capacity is the device's): here on
    a plain module, 1,000 fp32 parameters under AdamW are 16 kB per rank."""
    module = nn.Linear(100, 10, bias=False)
    adamw = torch.optim.AdamW(module.parameters())
    assert check_fits(module, [adamw], 16_000, "layout x") == 16_000
    with pytest.raises(
        LayoutError, match=r"layout x cannot fit: each rank holds 0\.02 MiB .* x 4\) .*cpu_offload=True"
    ):
        check_fits(module, [adamw], 15_999, "layout x")
    sgd = torch.optim.SGD(module.parameters(), lr=0.1)
    assert check_fits(module, [sgd], 8_000, "layout x") == 8_000  # parameters and gradients only
