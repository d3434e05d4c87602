"""Attention with soft-capped scores (Gemma 2's ``softcap * tanh(s / softcap)``) by blocks, with each block's
log-sum-exp: the two kernels :mod:`cuboid.compat.attention` sends such blocks to. No flash or memory-efficient kernel
of torch computes the cap (torch builds FlashAttention without it), so:

- on CPU (``"cpu_softcap"``), the block written out (``rows x keys`` scores) with FlashAttention's backward written out
  for the cap (:func:`_softcapped_backward`);
- on CUDA (``"cuda_flex"``), FlexAttention compiled (a fused kernel), the cap its ``score_mod``, and the block's
  gradients by recomputing it under autograd with the gradients the merge gives its output and log-sum-exp
  (:func:`_backward_by_recompute`, checked on CPU with the written-out forward; ``tests/test_compat.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

INF = float("inf")


def _per_query_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values repeated to one per query head (``(batch, heads, tokens, dim)``)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _per_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of repeated keys or values summed back to their own heads."""
    batch, heads, tokens, dim = grad.shape
    return grad if heads == kv_heads else grad.view(batch, kv_heads, heads // kv_heads, tokens, dim).sum(2)


def _visible(shape: Any, real: torch.Tensor | None, rows: int, keys: int, device: Any) -> torch.Tensor | None:
    """``(batch or 1, 1, rows, keys)`` boolean: what each row sees of the block (None: every key)."""
    seen = shape.visible
    if shape.causal:
        seen = torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)
    if real is None:
        return None if seen is None else seen[None, None]
    pad = real[:, None, None, :]
    return pad if seen is None else pad & seen


def _capped_scores(
    query: torch.Tensor, key: torch.Tensor, scale: float | None, softcap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tanh(s / softcap), s)`` in the accumulation dtype (float32, float64 for float64), keys per query head."""
    wide = torch.promote_types(query.dtype, torch.float32)
    k = _per_query_head(key, query.shape[1]).to(wide)
    scores = (query.to(wide) @ k.transpose(-1, -2)) * (scale if scale is not None else query.shape[-1] ** -0.5)
    return torch.tanh(scores / softcap), scores


def _softcapped(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shape: Any, real: torch.Tensor | None,
    scale: float | None, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The soft-capped block written out (``rows x keys`` scores): its output and each row's log-sum-exp."""
    tanh, _ = _capped_scores(query, key, scale, softcap)
    capped = tanh * softcap
    seen = _visible(shape, real, query.shape[2], key.shape[2], query.device)
    if seen is not None:
        capped = capped.masked_fill(~seen, -INF)
    lse = torch.logsumexp(capped, dim=-1)
    probs = torch.exp(capped - lse.masked_fill(lse == -INF, 0.0).unsqueeze(-1))
    out = probs @ _per_query_head(value, query.shape[1]).to(probs.dtype)
    return out.to(query.dtype), lse


def _softcapped_backward(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, shape: Any, real: torch.Tensor | None, scale: float | None, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """FlashAttention's backward written out for soft-capped scores: ``P = exp(c - lse)`` with the whole row's
    ``lse``, ``dC = P (dO V^T - rowsum(dO O))``, and the cap's derivative ``1 - tanh^2`` on the way to the scores."""
    heads = query.shape[1]
    tanh, _ = _capped_scores(query, key, scale, softcap)
    wide = tanh.dtype
    capped = tanh * softcap
    seen = _visible(shape, real, query.shape[2], key.shape[2], query.device)
    probs = torch.exp(capped - lse.to(wide).unsqueeze(-1))
    if seen is not None:
        probs = probs.masked_fill(~seen, 0.0)
    g, o = grad_out.to(wide), out.to(wide)
    k, v = _per_query_head(key, heads).to(wide), _per_query_head(value, heads).to(wide)
    dv = probs.transpose(-1, -2) @ g
    dcapped = probs * (g @ v.transpose(-1, -2) - (g * o).sum(-1, keepdim=True))
    dscores = dcapped * (1 - tanh * tanh) * (scale if scale is not None else query.shape[-1] ** -0.5)
    dq = dscores @ k
    dk = dscores.transpose(-1, -2) @ query.to(wide)
    return (
        dq.to(query.dtype),
        _per_kv_head(dk, key.shape[1]).to(key.dtype),
        _per_kv_head(dv, value.shape[1]).to(value.dtype),
    )


def _backward_by_recompute(
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's gradients from a kernel with an autograd backward of its own: the block again under autograd, and
    its ``(out_b, lse_b)`` given the gradients the merge ``out = sum_b w_b out_b`` (``w_b = exp(lse_b - lse)``)
    passes them: ``w_b dO`` and ``w_b (rowsum(dO out_b) - rowsum(dO out))``. Their sum through the block's softmax is
    ``P (dO V^T - rowsum(dO out))`` with ``P = exp(s - lse)``: FlashAttention's backward with the whole row's
    ``out`` and ``lse``."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        block_out, block_lse = forward(q, k, v)
        wide = torch.promote_types(block_out.dtype, torch.float32)
        weight = torch.exp(block_lse.to(wide) - lse.to(wide)).nan_to_num(0.0)  # a row with no key: no weight
        g = grad_out.to(wide)
        d_out = (weight.unsqueeze(-1) * g).to(block_out.dtype)
        d_lse = weight * ((g * block_out.to(wide)).sum(-1) - (g * out.to(wide)).sum(-1))
        return torch.autograd.grad((block_out, block_lse), (q, k, v), (d_out, d_lse.to(block_lse.dtype)))


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """FlexAttention compiled once (its eager form is a reference implementation, not a fused kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def _flex_call(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shape: Any, real: torch.Tensor | None,
    scale: float | None, softcap: float, compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """FlexAttention over the block with the soft-cap as its ``score_mod`` and the block's window, diagonal and padding
    as ``-inf`` scores (tensors it reads by index, so one compiled kernel serves every block), and its log-sum-exp."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # (return_lse: deprecated in 2.13)

    rows, keys = query.shape[2], key.shape[2]
    left, right = shape.window or (None, None)
    if shape.causal:
        left, right = None, 0
    row = torch.arange(rows, device=query.device)
    low = row + (keys - rows) - (left if left is not None else keys + rows)
    high = row + (keys - rows) + (right if right is not None else keys + rows)
    keep = real if real is not None else torch.ones(1, keys, dtype=torch.bool, device=query.device)
    whole_batch = keep.shape[0] > 1

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> Any:
        seen = (kv >= low[q]) & (kv <= high[q]) & keep[b if whole_batch else 0, kv]
        return torch.where(seen, softcap * torch.tanh(score / softcap), -INF)

    run = _compiled_flex() if compiled else flex_attention
    out, aux = run(query, key, value, score_mod=score_mod, scale=scale, enable_gqa=key.shape[1] != query.shape[1],
                   return_aux=AuxRequest(lse=True))  # fmt: skip
    return out, aux.lse
