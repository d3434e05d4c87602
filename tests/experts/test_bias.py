"""Balancing experts without an auxiliary loss (``cuboid.experts.bias``), in one process: which routers are found
and how, that a zero bias chooses exactly as the router did and a bias moves the choice but not the weights, that a
step's counts take each forward once (a checkpointed block's recompute not again, a reentrant checkpoint's forward
under no_grad once), the update rule, no host read,
and the refusals. The layouts (dp, tp, ep, pp, cp and their products) are in ``test_expert_parallel.py``."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import third_party
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from cuboid.experts import ExpertBias, ExpertBiasError, find_routers
from cuboid.models.llama import CONFIGS, Llama

DEVICE = torch.device("cpu")


def _moe_llama(layers: int = 2) -> Llama:
    torch.manual_seed(0)
    model = Llama(replace(CONFIGS["moe_debug"], vocab_size=256, n_layers=layers))
    model.init_weights()
    return model


def _blocks(model: nn.Module, container: str) -> list[tuple[str, nn.Module]]:
    holder = model.get_submodule(container)
    return [(f"{container}.{name}", block) for name, block in holder.named_children()]


FAMILIES = {  # model, its blocks' container, the router's class name
    "cuboid_moe": (lambda: _moe_llama(), "layers", "Router"),
    "hf_qwen3_moe": (lambda: third_party.build_model("hf_qwen3_moe"), "model.layers", "Qwen3MoeTopKRouter"),
    "hf_mixtral": (lambda: third_party.build_model("hf_mixtral"), "model.layers", "MixtralTopKRouter"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_zero_bias_chooses_as_the_router_did_and_a_bias_moves_the_choice_not_the_weights(family: str) -> None:
    build, container, kind = FAMILIES[family]
    model = build()
    routers = find_routers(model)
    assert routers and all(type(r).__name__ == kind and not own for _, r, own in routers), routers
    name, router, _ = routers[0]
    x = torch.randn(24, router.weight.shape[1])
    before = router(x)
    bias = ExpertBias(1e-3)
    bias.setup(_blocks(model, container), [], DEVICE)
    assert [r.name for r in bias.routers] == [n for n, _, _ in routers]
    after = router(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the very same choice and weights
    assert name + ".expert_bias" in dict(model.named_buffers())  # persistent: in every checkpoint
    # a bias that outweighs any score difference: every token takes experts 0 and 1, weighted by its own scores
    router.expert_bias.copy_(torch.tensor([10.0, 9.0] + [0.0] * (router.weight.shape[0] - 2)))
    _, weights, index = router(x)
    assert torch.equal(index, torch.tensor([[0, 1]]).expand(24, 2))
    probs = torch.softmax(nn.functional.linear(x, router.weight), dim=-1, dtype=torch.float32)[:, :2]
    normalise = family != "hf_qwen3_moe" or router.norm_topk_prob
    expected = probs / probs.sum(dim=-1, keepdim=True) if normalise else probs
    torch.testing.assert_close(weights.float(), expected, rtol=1e-6, atol=1e-7)


def test_deepseek_v3s_own_selection_bias_is_the_one_moved_and_its_forward_is_its_own() -> None:
    model = third_party.build_model("hf_deepseek_v3")
    routers = find_routers(model)
    assert routers and all(own for _, _, own in routers)
    forwards = [r.forward for _, r, _ in routers]
    bias = ExpertBias(1e-3)
    bias.setup(_blocks(model, "model.layers"), [], DEVICE)
    assert [r.forward for _, r, _ in routers] == forwards
    assert all(b.bias is b.module.e_score_correction_bias for b in bias.routers)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert all(c.sum() == 2 * 16 * model.config.num_experts_per_tok for c in bias.counts)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_step_counts_each_forward_once_and_a_checkpointed_recompute_not_again(reentrant: bool) -> None:
    model = _moe_llama()
    for block in model.layers.values():  # activation checkpointing: each block's forward runs again in backward
        block.forward = lambda *a, f=block.forward, **k: checkpoint(partial(f, **k), *a, use_reentrant=reentrant)
    bias = ExpertBias(1e-3)
    bias.setup(_blocks(model, "layers"), [], DEVICE)
    tokens = torch.randint(0, 256, (2, 16))
    for _ in range(2):  # two micro-batches of one optimizer step (gradient accumulation)
        model(tokens).sum().backward()
    top_k = model.layers["0"].feed_forward.router.top_k
    assert [int(c.sum()) for c in bias.counts] == [2 * 2 * 16 * top_k] * 2
    model.eval()  # validation counts nothing
    with torch.no_grad():
        model(tokens)
    model(tokens)
    assert [int(c.sum()) for c in bias.counts] == [2 * 2 * 16 * top_k] * 2


def test_the_update_moves_each_bias_toward_even_load_by_the_rate_and_keeps_its_mean() -> None:
    model = _moe_llama()
    bias = ExpertBias(0.5)
    bias.setup(_blocks(model, "layers"), [], DEVICE)
    first, second = bias.routers
    bias.counts = [
        torch.tensor([3.0, 1.0, 0.0, 4.0]),  # mean 2: [-1, 1, 1, -1] x 0.5, mean 0
        torch.tensor([4.0, 0.0, 0.0, 0.0]),
    ]  # mean 1: [-1, 1, 1, 1] x 0.5, less its mean 0.25
    bias.update()
    assert first.bias.tolist() == [-0.5, 0.5, 0.5, -0.5]
    assert second.bias.tolist() == [-0.75, 0.25, 0.25, 0.25]
    assert bias.counts == [None, None]
    assert bias.imbalance.tolist() == [2.0, 4.0]  # max / mean tokens per expert, per layer
    bias.update()  # no forward since: nothing moves
    assert first.bias.tolist() == [-0.5, 0.5, 0.5, -0.5]


def test_counting_and_the_update_read_nothing_back_from_the_device(tmp_path: Path) -> None:
    """On a one-rank gloo group, a step's forward, backward and the update's all-reduce use none of the operators
    that sync on a GPU (``tests/experts/test_load.py``'s list)."""
    from test_load import SyncOps

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = _moe_llama()
        bias = ExpertBias(1e-3)
        bias.setup(_blocks(model, "layers"), [("dp_cp", dist.group.WORLD)], DEVICE)
        bias.groups = [dist.group.WORLD]  # a one-rank group is left out; summed here to see the collective too
        with SyncOps() as ops:
            model(torch.randint(0, 256, (2, 16))).sum().backward()
            bias.update()
        assert ops.seen == []
        assert all(r.bias.abs().sum() > 0 for r in bias.routers)
    finally:
        dist.destroy_process_group()


def test_the_bias_moves_after_the_step_of_the_optimizer_that_steps_the_routers() -> None:
    model = _moe_llama()
    bias = ExpertBias(1e-2)
    bias.setup(_blocks(model, "layers"), [], DEVICE)
    others = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # a second optimizer (a GAN's other one)
    routers = torch.optim.SGD(model.parameters(), lr=0.1)
    bias.watch([others, routers])
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    others.step()
    assert all(r.bias.abs().sum() == 0 for r in bias.routers) and all(c is not None for c in bias.counts)
    routers.step()
    assert all(r.bias.abs().sum() > 0 for r in bias.routers) and bias.counts == [None, None]


def test_a_second_fit_moves_the_bias_after_its_own_optimizer() -> None:
    """The same strategy's next setup (a second ``trainer.fit``) drops the hook on the earlier fit's optimizer and
    watches the new one."""
    model = _moe_llama()
    bias = ExpertBias(1e-2)
    bias.setup(_blocks(model, "layers"), [], DEVICE)
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    bias.watch([first])
    bias.setup(_blocks(model, "layers"), [], DEVICE)
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    bias.watch([second])
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    first.step()
    assert all(r.bias.abs().sum() == 0 for r in bias.routers)
    second.step()
    assert all(r.bias.abs().sum() > 0 for r in bias.routers) and bias.counts == [None, None]
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens).sum().backward()  # counted once, not once per setup
    top_k = model.layers["0"].feed_forward.router.top_k
    assert [int(c.sum()) for c in bias.counts] == [2 * 16 * top_k] * 2


def test_bad_input_is_refused_by_name() -> None:
    from cuboid import CuboidStrategy

    for rate in (0, -1e-3, "fast", True):
        with pytest.raises(ExpertBiasError, match="expert_bias_rate"):
            CuboidStrategy(expert_bias_rate=rate)
    dense = Llama(replace(CONFIGS["debug"], vocab_size=256, n_layers=1))
    with pytest.raises(ExpertBiasError, match="Llama has no mixture-of-experts block"):
        ExpertBias(1e-3).check(dense)
    ExpertBias(None).check(dense)  # off: nothing asked

    model = _moe_llama(1)
    moe = model.layers["0"].feed_forward
    moe.second_router = nn.Linear(moe.router.weight.shape[1], moe.router.weight.shape[0])  # two could be routers
    with pytest.raises(ExpertBiasError, match=r"layers\.0\.feed_forward .* 2 modules .*\(router, second_router\)"):
        ExpertBias(1e-3).check(model)

    model = _moe_llama(1)
    router = model.layers["0"].feed_forward.router

    def argmax_router(x: torch.Tensor):  # chooses without torch.topk
        probs = torch.softmax(nn.functional.linear(x, router.weight), dim=-1)
        index = probs.argmax(dim=-1, keepdim=True).expand(-1, 2).contiguous()
        return probs, probs.gather(-1, index), index

    router.forward = argmax_router
    bias = ExpertBias(1e-3)
    bias.setup(_blocks(model, "layers"), [], DEVICE)
    with pytest.raises(ExpertBiasError, match="without torch.topk"):
        model(torch.randint(0, 256, (2, 16)))
