"""Expert parallel's exchange (cuboid.experts): each chosen (token, expert) pair sent to the rank holding its
expert and back, against the unsharded layer of three transformers families, forward and backward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import WORKERS, torchrun

from cuboid.experts import ExpertParallelError, expert_block


def test_experts_split_in_equal_contiguous_blocks_and_a_degree_that_does_not_divide_says_the_fix() -> None:
    assert [expert_block(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ExpertParallelError, match=r"expert_parallel=3 does not divide the 8 experts .* divides 8"):
        expert_block(8, 3, 0)


@pytest.mark.slow
def test_tokens_reach_the_ranks_holding_their_experts_with_the_unsharded_layers_result(tmp_path: Path) -> None:
    """Two ep ranks, 4 experts (2 each), Qwen3-MoE, Mixtral and GPT-OSS experts. Forced routing: rank 0 holds none
    of its own batch's experts (it sends every pair to rank 1 and receives rank 1's expert-0 pairs), expert 1 gets
    no token, one pair is dropped (sentinel id). Also the layers' own routers on random tokens. Outputs, input
    gradients, local expert gradients and summed router gradients equal the whole layer's to float32 round-off."""
    out = tmp_path / "experts.json"
    torchrun(2, WORKERS / "experts_worker.py", str(out), timeout=180)
    found = json.loads(out.read_text())
    splits = found.pop("splits")
    assert splits[0]["send"] == [0, 24] and splits[0]["recv"][1] > 0, splits  # rank 0: none of its pairs stays
    assert splits[0]["per_local_expert"][1] == 0 and sum(splits[1]["send"]) == 2 * 12 - 1  # one pair dropped
    assert set(found) == {f"{f}/{r}" for f in ("qwen3_moe", "mixtral", "gpt_oss") for r in ("forced", "router")}
    for case, worst in found.items():
        assert max(worst.values()) < 1e-5, (case, worst)
        assert {"out", "dx", "dgate_up_proj", "ddown_proj"} <= set(worst), (case, worst)
