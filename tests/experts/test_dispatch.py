"""Expert parallel's exchange (cuboid.experts): each chosen (token, expert) pair sent to the rank holding its
expert and back, against the unsharded layer of three transformers families, forward and backward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import WORKERS, torchrun

from cuboid.experts import ExpertParallelError, expert_block


def test_experts_split_in_equal_contiguous_blocks_and_a_degree_that_does_not_divide_says_the_fix() -> None:
    assert [expert_block(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ExpertParallelError, match=r"expert_parallel=3 does not divide the 8 experts .* divides 8"):
        expert_block(8, 3, 0)


@pytest.mark.parametrize("sources, experts", [(2, 2), (3, 4), (4, 1), (1, 3)])
def test_received_rows_are_regrouped_by_expert_with_an_index_made_on_the_device(sources: int, experts: int) -> None:
    """Rows arrive grouped by source rank, then by expert; the local experts take them grouped by expert, then by
    source. The gather index is computed from the device's counts (empty blocks too), equal to the block-by-block
    reading of it, and no tensor of it is made on the host: every factory call names the counts' device."""
    from torch.overrides import TorchFunctionMode

    from cuboid.experts.dispatch import _regroup_index

    counts = torch.randint(0, 4, (sources, experts), generator=torch.Generator().manual_seed(sources * 10 + experts))
    counts[0, -1] = 0  # an expert that got nothing from one source
    flat, blocks, at = counts.reshape(-1).tolist(), [], 0
    for s in range(sources):
        for e in range(experts):
            blocks.append((e, s, at, flat[s * experts + e]))
            at += flat[s * experts + e]
    expected = torch.cat([torch.arange(a, a + n) for _, _, a, n in sorted(blocks)])
    made: list[object] = []

    class Factories(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.arange, torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full):
                made.append((func.__name__, (kwargs or {}).get("device")))
            return func(*args, **(kwargs or {}))

    with Factories():
        got = _regroup_index(counts, int(counts.sum()))
    assert torch.equal(got, expected)
    assert all(device is not None for _, device in made), made


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


class _Experts(torch.nn.Module):  # what experts_modules takes for transformers' packed experts
    is_transposed, has_gate, num_experts = False, False, 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.sum(0)


class _MoeBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router, self.experts = torch.nn.Linear(4, 4), _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.router(x))


def test_each_block_prefetches_the_next_blocks_experts_with_it() -> None:
    """Under expert parallel each MoE layer's experts are an FSDP unit of their own, the bulk of a block's bytes:
    the block before issues their all-gather with the next block's in forward, and the block after with the one
    before in backward (issue 67, item 7; torchtitan's llama4 does the same), so none waits for its router."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from cuboid.parallel.mesh import ExpertsLayout
    from cuboid.parallel.parallelize import apply_fsdp

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        root = torch.nn.Sequential(*(_MoeBlock() for _ in range(3)))
        blocks = [(str(i), block) for i, block in enumerate(root)]
        apply_fsdp([(root, blocks)], mesh, MixedPrecisionPolicy(), experts=ExpertsLayout(mesh, mesh, 1))

        def named(states: list) -> list[str]:  # FSDP2's prefetch lists hold states: back to the modules' names
            names = {id(m._get_fsdp_state()): n for n, m in root.named_modules() if hasattr(m, "_get_fsdp_state")}
            return [names[id(state)] for state in states]

        forward = [named(root[i]._get_fsdp_state()._states_to_forward_prefetch) for i in range(3)]
        backward = [named(root[i]._get_fsdp_state()._states_to_backward_prefetch) for i in range(3)]
        assert forward == [["1", "1.experts"], ["2", "2.experts"], []], forward
        assert backward == [[], ["0", "0.experts"], ["1", "1.experts"]], backward
        root(torch.randn(2, 4)).sum().backward()  # (and the prefetches run)
    finally:
        if started:
            dist.destroy_process_group()
