"""Context parallel's attention (cuboid.context.attention): the load-balanced split, and exact attention across the
shards against full attention, forward and backward, to float32 round-off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import WORKERS, torchrun

from cuboid.context.attention import ContextParallelError, chunk_ids, local_positions, shard_sequence, unshard_sequence


def test_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i() -> None:
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(2 * 24).view(2, 24)
    assert torch.equal(unshard_sequence([shard_sequence(x, r, 3) for r in range(3)]), x)
    # the causal work (keys each query attends to) is the same on every rank
    work = [int((local_positions(64, r, 4) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work


def test_a_sequence_not_divisible_by_twice_cp_says_the_fix() -> None:
    with pytest.raises(
        ContextParallelError, match=r"65 tokens cannot be split over context_parallel=2: .* multiple of"
    ):
        local_positions(65, 0, 2)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_full_attention_forward_and_backward(cp: int, tmp_path: Path) -> None:
    """Random q, k, v (MHA, GQA, causal and not, right- and left-padded keys), each cp rank's share: its output and
    its q, k, v gradients equal full attention's on the same tokens. And no tensor of the cp calls, forward or
    backward, holds both a query length (the rank's tokens, or a chunk) and the whole sequence: no ``Lq x S`` mask
    or scores (before the block path, every call made a boolean ``Lq x S`` mask)."""
    out = tmp_path / "worst.json"
    torchrun(cp, WORKERS / "context_worker.py", str(out), timeout=180)
    worst = json.loads(out.read_text())
    big = worst.pop("big")
    print(f"cp{cp}: largest relative difference vs full attention: {worst}")
    assert max(worst.values()) <= 1e-5, worst
    assert big == [], big[:10]


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process: cp = 1 still cuts each sequence into two query chunks (``0`` and
    ``1``), so the block path runs whole (blocks, merges, the exchange over one rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_strided_log_sum_exp_handed_to_the_backward_breaks_flash_attentions_contract(one_rank, monkeypatch) -> None:
    """The mutation of issue 57's first finding: the backward hands each kernel a slice of the whole log-sum-exp
    instead of a tensor of its own. The CPU kernel honours strides (the numbers stay right), FlashAttention's backward
    reads it as contiguous (wrong gradients on a GPU, no error); under ``CudaContracts`` it stops, naming it."""
    from cuboid.compat import CudaContractError, CudaContracts
    from cuboid.context import blocks
    from cuboid.context.attention import cp_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=g).requires_grad_() for _ in range(3))
    with CudaContracts() as contracts:  # as the code is: each checked op passes
        cp_attention(q, k, v, one_rank, 32).sum().backward()
    assert contracts.checked["_scaled_dot_product_flash_attention_for_cpu_backward"] == 3, contracts.checked
    monkeypatch.setattr(blocks, "_own", lambda tensor, rows: tensor[:, :, rows])
    with CudaContracts(), pytest.raises(CudaContractError, match=r"log-sum-exp must be contiguous"):
        cp_attention(q, k, v, one_rank, 32).sum().backward()
    monkeypatch.undo()
    out = cp_attention(q, k, v, one_rank, 32)  # unchecked, the strided slice gives the same numbers on CPU
    monkeypatch.setattr(blocks, "_own", lambda tensor, rows: tensor[:, :, rows])
    strided = torch.autograd.grad(cp_attention(q, k, v, one_rank, 32).sum(), q)[0]
    assert torch.allclose(strided, torch.autograd.grad(out.sum(), q)[0])


def test_attention_dropout_and_head_dims_no_kernel_takes_are_refused_by_name(one_rank) -> None:
    from cuboid.context.attention import cp_attention

    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(ContextParallelError, match=r"attention dropout \(dropout_p=0.1\).*attention_dropout=0.0"):
        cp_attention(q, q, q, one_rank, 16, dropout_p=0.1)
    with pytest.raises(ContextParallelError, match=r"int64 attention on CPU"):
        cp_attention(q.long(), q.long(), q.long(), one_rank, 16)
