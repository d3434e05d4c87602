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
