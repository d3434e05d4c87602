"""Expert load counting (cuboid.experts.load) and the exchange's host reads, counted on the CPU by the operators
that read the device back on a GPU (``SYNCING``): counting adds none, and the exchange's only read is the one it
needs for its splits (a ``tolist`` of the counts, which the dispatcher does not see on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import third_party
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cuboid.experts import combine, dispatch
from cuboid.experts.load import ExpertLoad, load_figures

# aten operators whose CUDA kernels wait for the device to learn an output size or a value: a host sync each.
SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "bincount", "_unique2", "unique_dim",
           "unique_consecutive")  # fmt: skip
# repeat_interleave with a tensor of repeats reads their sum back to size its output, unless output_size is given


class SyncOps(TorchDispatchMode):
    """Counts operators that sync on a GPU, and indexing with a boolean mask (a ``nonzero`` inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masked = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        )
        sized = name == "repeat_interleave" and (kwargs or {}).get("output_size") is None
        if name in SYNCING or masked or sized:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _forward(model: torch.nn.Module, tokens: torch.Tensor) -> list[str]:
    with SyncOps() as ops:
        model(input_ids=tokens, labels=tokens).loss.backward()
    return ops.seen


@pytest.mark.parametrize("family", ["hf_qwen3_moe", "hf_mixtral"])
def test_counting_adds_no_host_sync_and_counts_what_the_routers_chose(family: str) -> None:
    model = third_party.initial_model(family)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    baseline = _forward(model, tokens)
    load = ExpertLoad(model)
    assert len(load) == model.config.num_hidden_layers
    assert _forward(model, tokens) == baseline and all(c is None for c in load.counts)  # off: nothing at all
    chosen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda _m, _a, out: chosen.append(out[2].reshape(-1)))
    load.on = True
    assert _forward(model, tokens) == baseline  # on: device-side counting, no read
    expected = torch.stack([torch.bincount(c, minlength=4).float() for c in chosen])
    assert torch.equal(torch.stack(load.counts), expected), (load.counts, expected)
    figures = load.take(groups=[])
    assert figures == load_figures(expected) and figures["moe/tokens_per_expert_mean"] == 2 * 4 * 33 / 4
    assert all(c is None for c in load.counts)  # taken: reset for the next logging step
    load.remove()
    _forward(model, tokens)
    assert all(c is None for c in load.counts)


def test_dropped_pairs_are_not_counted_and_an_idle_expert_shows() -> None:
    counts = torch.tensor([[4.0, 0.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]])
    assert load_figures(counts) == {
        "moe/tokens_per_expert_max": 4.0,
        "moe/tokens_per_expert_mean": 2.0,
        "moe/load_imbalance": 2.0,
        "moe/idle_experts": 1.0,
    }
    model = third_party.initial_model("hf_qwen3_moe")
    load = ExpertLoad(model)
    load.on = True
    name, experts = next(iter(_experts(model)))
    experts(torch.randn(3, experts.gate_up_proj.shape[-1]), torch.tensor([[0, 4], [4, 4], [1, 0]]), torch.ones(3, 2))
    assert load.counts[0].tolist() == [2.0, 1.0, 0.0, 0.0], name  # id 4 = num_experts: dropped, not counted


def _experts(model: torch.nn.Module):
    from cuboid.experts import experts_modules

    return experts_modules(model)


def test_the_exchange_reads_the_device_once_per_layer(tmp_path: Path) -> None:
    """``dispatch`` and ``combine`` on a one-rank gloo group: none of the operators that sync on a GPU (the
    counts are binned with ``index_add_``, not ``bincount`` or a boolean mask); the split sizes' ``tolist`` is
    the one read."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        hidden = torch.randn(6, 8, requires_grad=True)
        index = torch.tensor([[0, 3], [2, 4], [1, 0], [3, 3], [4, 4], [0, 1]])  # 4 = dropped
        weights = torch.rand(6, 2)
        with SyncOps() as ops:
            rows, counts, routed = dispatch(hidden, index, 4, dist.group.WORLD)
            out = combine(rows * 2.0, weights, routed)
            out.sum().backward()
        assert ops.seen == [], ops.seen
        assert counts == [3, 2, 1, 3]  # pairs per (local) expert, the dropped ones left out
        keep = (index < 4).float() * weights
        assert torch.allclose(out, 2.0 * hidden.detach() * keep.sum(dim=1, keepdim=True))
    finally:
        dist.destroy_process_group()


def test_cuboids_own_moe_runs_its_experts_without_a_sync_per_expert() -> None:
    """``cuboid.models.moe.Experts`` sorts the pairs by expert (one ``tolist`` of the group sizes per layer), where
    a boolean mask per expert would read the device once per expert; its load is counted like transformers'."""
    from dataclasses import replace

    from cuboid.models.llama import CONFIGS, Llama

    torch.manual_seed(0)
    model = Llama(replace(CONFIGS["moe_debug"], vocab_size=256, n_layers=2))
    model.init_weights()
    load = ExpertLoad(model)
    load.on = True
    tokens = torch.randint(0, 256, (2, 16))
    with SyncOps() as ops:
        model(tokens).sum().backward()
    assert ops.seen == [], ops.seen
    assert len(load) == 2 and [float(c.sum()) for c in load.counts] == [2 * 32, 2 * 32]


@pytest.mark.parametrize("ac", [None, "full", "selective"])
def test_a_checkpointed_layer_reads_its_splits_once_and_its_recompute_takes_them_back(ac, tmp_path: Path) -> None:
    """An expert layer under activation checkpointing (``cuboid.parallel``'s per-block checkpoint, full or
    selective): one host read of the split sizes per layer and forward, the recompute included
    (``RoutingReplay``): the recompute neither exchanges the counts again nor reads them back; only the token
    exchange runs again. The gradients are the unchecked layer's."""
    from torch.overrides import TorchFunctionMode
    from torch.utils.checkpoint import noop_context_fn

    from cuboid.parallel.parallelize import _checkpointed, _sac_context

    class Reads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.reads += func is torch.Tensor.tolist
            return func(*args, **(kwargs or {}))

    class Exchanges(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.namespace == "c10d" and func.__name__.startswith("alltoall")
            return func(*args, **(kwargs or {}))

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        index = torch.tensor([[0, 3], [2, 4], [1, 0], [3, 3], [4, 4], [0, 1]])
        weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(0))

        def layer(hidden: torch.Tensor) -> torch.Tensor:
            rows, _, routed = dispatch(hidden, index, 4, dist.group.WORLD)
            return combine(torch.tanh(rows) * 2.0, weights, routed)

        hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        run = layer if ac is None else _checkpointed(layer, _sac_context if ac == "selective" else noop_context_fn)
        with Reads() as reads, Exchanges() as exchanges:
            run(hidden).pow(2).sum().backward()
        got = hidden.grad.clone()
        hidden.grad = None
        layer(hidden).pow(2).sum().backward()
    finally:
        dist.destroy_process_group()
    assert reads.reads == 1, reads.reads
    # forward: the counts and two token exchanges; backward: two; a recompute: the two token exchanges again
    assert exchanges.count == (5 if ac is None else 7), exchanges.count
    assert torch.allclose(got, hidden.grad)
