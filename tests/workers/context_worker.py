"""Context-parallel attention against full attention on random inputs, on every cp rank (a torchrun worker).

Writes, from rank 0, the largest relative differences of the output and of the query, key and value gradients
(each rank's share compared with the same tokens of full attention on one rank, by blocks), and every tensor the
block path made that holds both a query length (this rank's tokens, or one chunk of them) and the whole sequence's
(an ``Lq x S`` mask or score matrix: it makes none, with padding, a sliding window, a sink or soft-capping too), to
``sys.argv[1]``. The CUDA kernels' preconditions are checked on every aten op the blocks call
(``cuboid.compat.contracts``).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from cuboid.compat.contracts import CudaContracts
from cuboid.context.attention import cp_attention, local_positions, shard_sequence
from cuboid.job.launch import close_process_groups


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


class Shapes(TorchDispatchMode):
    """Every output shape holding a query length and the whole sequence's ``seq`` (a dimension of each)."""

    def __init__(self, seq: int, rows: set[int]) -> None:
        super().__init__()
        self.seq, self.rows = seq, rows
        self.found: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.seq in t.shape and self.rows & set(t.shape) and _owns(t):
                self.found.append((str(func), tuple(t.shape)))
        return out


def _owns(t: torch.Tensor) -> bool:
    """Whether ``t`` holds its elements (not a broadcast view of fewer: an ``expand``)."""
    return t.untyped_storage().nbytes() >= t.numel() * t.element_size()


def padding(seq: int, side: str | None) -> torch.Tensor | None:
    """``(2, seq)``, true where a token is real: two samples padded on ``side`` to different lengths."""
    if side is None:
        return None
    real = torch.ones(2, seq, dtype=torch.bool)
    for row, length in enumerate((seq - seq // 3, seq // 4)):
        real[row, length:] = False
    return real if side == "right" else real.flip(1)


def eager(q, k, v, mask, sink, softcap) -> torch.Tensor:
    """transformers' eager attention (Gemma 2's, GPT-OSS's): scores soft-capped, masked with the dtype's minimum,
    the sink's logit per head joining each row's softmax, then dropped."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min if softcap else float("-inf"))
    if sink is None:
        return torch.softmax(scores, -1) @ v
    column = sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    return probs @ v


def main() -> None:
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    worst: dict[str, float] = {}
    big: list = []
    # (heads, kv heads, tokens, causal, padding, sliding window, sink, soft cap): the windows (transformers'
    # sliding_window, a query at q sees the keys q - w < k <= q) shorter than a chunk (96 / 2cp tokens), longer than
    # one, and covering all; attention sinks (GPT-OSS's: a logit per head in every row's softmax, of value zero);
    # scores soft-capped (Gemma 2's softcap * tanh(scores / softcap), at 2 so that it bites).
    cases = ((4, 4, 96, True, None, None, False, None), (4, 2, 192, True, None, None, False, None),
             (2, 1, 96, False, None, None, False, None), (4, 2, 96, True, "right", None, False, None),
             (4, 2, 96, True, "left", None, False, None), (2, 1, 96, False, "left", None, False, None),
             (4, 2, 96, True, None, 5, False, None), (4, 2, 96, True, None, 30, False, None),
             (4, 4, 96, True, None, 96, False, None), (4, 2, 96, True, "right", 20, False, None),
             (4, 2, 96, True, "left", 7, False, None), (4, 2, 96, True, None, None, True, None),
             (4, 2, 96, True, "left", 20, True, None), (2, 1, 96, False, None, None, True, None),
             (4, 2, 96, True, None, None, False, 2.0), (4, 2, 96, True, "right", 20, True, 2.0),
             (2, 1, 96, False, "left", None, False, 2.0))  # fmt: skip
    for heads, kv_heads, seq, causal, side, window, with_sink, softcap in cases:
        g = torch.Generator().manual_seed(seq + heads)
        q = torch.randn(2, heads, seq, 16, generator=g, dtype=torch.float64).float().requires_grad_()
        k = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=torch.float64).float().requires_grad_()
        v = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=torch.float64).float().requires_grad_()
        grad_out = torch.randn(2, heads, seq, 16, generator=g)
        real = padding(seq, side)
        mask = None
        if window is not None:  # causal, and the window's lower edge
            mask = torch.ones(seq, seq, dtype=torch.bool).tril() & ~torch.ones(seq, seq, dtype=torch.bool).tril(-window)
        if real is not None:
            rows = mask if mask is not None else torch.ones(seq, seq, dtype=torch.bool).tril() if causal else True
            mask = real[:, None, None, :] & rows
        sink = torch.randn(heads, generator=g, dtype=torch.float64).float().requires_grad_() if with_sink else None
        if sink is None and softcap is None:
            full = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=kv_heads != heads
            )
        else:
            if mask is None and causal:
                mask = torch.ones(seq, seq, dtype=torch.bool).tril()
            full = eager(q, k, v, mask, sink, softcap)
        full.backward(grad_out)
        index = local_positions(seq, rank, cp)
        mine = [shard_sequence(t.detach(), rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
        my_sink = sink.detach().clone().requires_grad_() if sink is not None else None
        with Shapes(seq, {seq // cp, seq // (2 * cp)}) as shapes, CudaContracts():
            out = cp_attention(
                *mine, dist.group.WORLD, seq, is_causal=causal, enable_gqa=kv_heads != heads, key_padding=real,
                window=window, sink=my_sink, softcap=softcap,
            )  # fmt: skip
            out.backward(shard_sequence(grad_out, rank, cp, dim=2))
        big += shapes.found
        pairs = {"out": (out, full.detach()), "dq": (mine[0].grad, q.grad), "dk": (mine[1].grad, k.grad),
                 "dv": (mine[2].grad, v.grad)}  # fmt: skip
        for name, (got, want) in pairs.items():
            worst[name] = max(worst.get(name, 0.0), rel(got, want.index_select(2, index)))
        if sink is not None:  # each rank's rows' share of the sink's gradient, summed over cp
            assert my_sink is not None and my_sink.grad is not None
            dist.all_reduce(my_sink.grad)
            worst["dsink"] = max(worst.get("dsink", 0.0), rel(my_sink.grad, sink.grad))
    everyone = [None] * cp
    dist.all_gather_object(everyone, {**worst, "big": big})
    if rank == 0:
        merged = {name: max(w[name] for w in everyone) for name in worst if name != "big"}
        merged["big"] = [found for w in everyone for found in w["big"]]
        with open(sys.argv[1], "w") as f:
            json.dump(merged, f)
    close_process_groups()  # destroyed, and no gloo thread still at work when the interpreter finalizes


if __name__ == "__main__":
    main()
