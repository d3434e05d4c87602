"""The load-balancing statistic Cuboid sums over ranks and pipeline stages (``cuboid.experts.balance``) gives what
transformers' own ``load_balancing_loss_func`` gives, with and without a padding mask, and its parts add up: the
loss of two halves' summed parts is the loss of the whole batch. A loss of another form is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_loss
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as qwen3_moe_loss

from cuboid.experts import ExpertParallelError
from cuboid.experts.balance import LoadBalancing, _SumOverRanks, loss_of, statistics

EXPERTS, TOP_K, LAYERS, BATCH, SEQ = 8, 2, 3, 4, 6


def _logits(seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    return tuple(torch.randn(BATCH * SEQ, EXPERTS) * 2 for _ in range(LAYERS))


@pytest.mark.parametrize("function", [qwen3_moe_loss, mixtral_loss], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("padded", [False, True])
def test_the_parts_give_the_models_own_loss_and_add_up(function, padded: bool) -> None:
    logits = _logits(0)
    mask = None
    if padded:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, 4:] = 0
        mask[3, 1:] = 0
    theirs = function(logits, EXPERTS, TOP_K, mask)
    ours = loss_of(statistics(logits, EXPERTS, TOP_K, mask), EXPERTS)
    assert torch.allclose(ours, theirs, rtol=1e-6), (ours, theirs)
    # two ranks' halves of the batch (rows are batch-major): their parts summed give the whole batch's loss
    half = BATCH // 2 * SEQ
    parts = [
        statistics([t[:half] for t in logits], EXPERTS, TOP_K, None if mask is None else mask[: BATCH // 2]),
        statistics([t[half:] for t in logits], EXPERTS, TOP_K, None if mask is None else mask[BATCH // 2 :]),
    ]
    assert torch.allclose(loss_of(parts[0] + parts[1], EXPERTS), theirs, rtol=1e-6)
    # ... and the mean of the halves' own losses is not it (what each rank alone would compute)
    local = (function(tuple(t[:half] for t in logits), EXPERTS, TOP_K) + function(
        tuple(t[half:] for t in logits), EXPERTS, TOP_K)) / 2  # fmt: skip
    if not padded:
        assert not torch.allclose(local, theirs, rtol=1e-4)


def test_the_gradient_reaches_the_router_logits_as_the_models_own() -> None:
    logits = [t.requires_grad_() for t in _logits(1)]
    qwen3_moe_loss(tuple(logits), EXPERTS, TOP_K).backward()
    theirs = [t.grad.clone() for t in logits]
    for t in logits:
        t.grad = None
    loss_of(statistics(logits, EXPERTS, TOP_K, None), EXPERTS).backward()
    for mine, expected in zip((t.grad for t in logits), theirs, strict=True):
        assert torch.allclose(mine, expected, rtol=1e-5, atol=1e-9)


def test_a_load_balancing_loss_of_another_form_is_refused() -> None:
    balance = LoadBalancing("global")
    logits = _logits(2)
    ours = loss_of(statistics(logits, EXPERTS, TOP_K, None), EXPERTS)
    with pytest.raises(ExpertParallelError, match=r"is not transformers' load_balancing_loss_func .* load_balancing="):
        balance.check(torch.nn.Linear(1, 1), ours * 2, ours)
    # not counted while not finite (a pipeline's shape inference on made-up inputs), then checked for real
    balance = LoadBalancing("global")
    balance.check(torch.nn.Linear(1, 1), torch.tensor(float("nan")), ours)
    balance.check(torch.nn.Linear(1, 1), ours.clone(), ours)
    assert balance.checked


def test_the_statistic_and_its_sum_read_nothing_back_from_the_device(tmp_path: Path) -> None:
    """On a one-rank gloo group: the parts (with a padding mask), their sum over ranks and the loss's backward use
    none of the operators that sync on a GPU (``tests/experts/test_load.py``'s list)."""
    from test_load import SyncOps

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        logits = [t.requires_grad_() for t in _logits(3)]
        mask = torch.ones(BATCH, SEQ)
        mask[0, 3:] = 0
        with SyncOps() as ops:
            parts = statistics(logits, EXPERTS, TOP_K, mask)
            loss_of(_SumOverRanks.apply(parts, [dist.group.WORLD], 2), EXPERTS).backward()
        assert ops.seen == []
        assert all(t.grad is not None for t in logits)
    finally:
        dist.destroy_process_group()


def test_cuboids_own_moe_blocks_reduce_their_statistics_once_per_forward_outside_the_blocks() -> None:
    """Cuboid's MoE (a load-balancing loss per block, from parts): under ``LoadBalancing`` no collective runs
    inside a block's forward; once the model's forward is over, every block's parts are summed over the step's ranks
    in one all-reduce of ``layers x (2E + 1)`` numbers, and each block's ``aux_loss`` is made from its row (here
    two ranks of torch's fake process group: the sum is this rank's parts, as one process's)."""
    from dataclasses import replace

    from torch.utils._python_dispatch import TorchDispatchMode

    from cuboid import compat
    from cuboid.models.llama import CONFIGS, Llama
    from cuboid.models.moe import MoE

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.inside, self.seen = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.seen.append((func.__name__, self.inside > 0, tuple(args[0][0].shape)))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = Llama(replace(CONFIGS["moe_debug"], vocab_size=256, n_layers=3))
    model.init_weights()
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens)
    alone = [m.aux_loss.detach().clone() for m in model.modules() if isinstance(m, MoE)]
    lm = torch.nn.Module()
    lm.model = model
    compat.init_fake_process_group(2)
    try:
        balance = LoadBalancing("global")
        blocks = [(f"model.layers.{i}", block) for i, block in enumerate(model.layers.values())]
        balance.setup(lm, blocks, [("dp_cp", dist.group.WORLD)], [], plain=True)
        seen = Collectives()
        for block in model.modules():
            if isinstance(block, MoE):
                block.register_forward_pre_hook(lambda *_: setattr(seen, "inside", seen.inside + 1))
                block.register_forward_hook(lambda *_: setattr(seen, "inside", seen.inside - 1))
        with balance.step(), seen:
            model(tokens)
    finally:
        dist.destroy_process_group()
    experts = model.layers["0"].feed_forward.router.weight.shape[0]
    assert seen.seen == [("allreduce_.default", False, (3, 2 * experts + 1))], seen.seen
    mine = [m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    assert all(torch.allclose(a, b) for a, b in zip(mine, alone, strict=True))
