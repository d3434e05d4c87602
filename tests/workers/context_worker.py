"""Context-parallel attention against full attention on random inputs, on every cp rank (a torchrun worker).

Writes, from rank 0, the largest relative differences of the output and of the query, key and value gradients
(each rank's share compared with the same tokens of full attention on one rank) to ``sys.argv[1]``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cuboid.context.attention import cp_attention, local_positions, shard_sequence
from cuboid.job.launch import close_process_groups


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    worst: dict[str, float] = {}
    for heads, kv_heads, seq, causal in ((4, 4, 64, True), (4, 2, 128, True), (2, 1, 64, False)):
        g = torch.Generator().manual_seed(seq + heads)
        q = torch.randn(2, heads, seq, 16, generator=g, dtype=torch.float64).float().requires_grad_()
        k = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=torch.float64).float().requires_grad_()
        v = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=torch.float64).float().requires_grad_()
        grad_out = torch.randn(2, heads, seq, 16, generator=g)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
        full.backward(grad_out)
        mine = [shard_sequence(t.detach(), rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
        out = cp_attention(*mine, dist.group.WORLD, seq, is_causal=causal, enable_gqa=kv_heads != heads)
        out.backward(shard_sequence(grad_out, rank, cp, dim=2))
        index = local_positions(seq, rank, cp)
        pairs = {"out": (out, full.detach()), "dq": (mine[0].grad, q.grad), "dk": (mine[1].grad, k.grad),
                 "dv": (mine[2].grad, v.grad)}  # fmt: skip
        for name, (got, want) in pairs.items():
            worst[name] = max(worst.get(name, 0.0), rel(got, want.index_select(2, index)))
    everyone = [None] * cp
    dist.all_gather_object(everyone, worst)
    if rank == 0:
        merged = {name: max(w[name] for w in everyone) for name in worst}
        with open(sys.argv[1], "w") as f:
            json.dump(merged, f)
    close_process_groups()  # destroyed, and no gloo thread still at work when the interpreter finalizes


if __name__ == "__main__":
    main()
