"""Context parallel's exact attention: each cp rank holds a load-balanced share of every sequence's tokens.

A sequence of ``S`` tokens is cut into ``2 x cp`` equal chunks; cp rank ``i`` holds chunks ``i`` and
``2 cp - 1 - i``, so under a causal mask every rank carries the same amount of work (no rank holds the long end of
the triangle alone). Attention over the whole sequence is exact: each rank gathers every rank's keys and values
over the cp group (one ``all_gather_into_tensor`` in forward, of the model's own key/value heads: a grouped-query
model's are not repeated first; its backward sums each chunk's key and value gradients back to the rank that holds
it with one ``reduce_scatter_tensor``, half an all-reduce's bytes), and masks by the tokens' *global* positions. Equal to full attention up to float32 round-off
(``tests/parallel/test_context.py``).

This is the CPU/gloo path; torch's ring attention (``context_parallel``) is the GPU fast path.
:func:`gather_tokens` brings per-token values (a loss before its reduction) back in global order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cuboid import compat
from cuboid.context.blocks import block_attention


class ContextParallelError(ValueError):
    """A sequence or attention call that cannot be split over context-parallel ranks; the message says the fix."""


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 x cp``) that cp rank ``cp_rank`` holds: ``i`` and ``2 cp - 1 - i``."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp_rank: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of the tokens cp rank ``cp_rank`` holds, in its local order."""
    if seq_len % (2 * cp):
        raise ContextParallelError(
            f"a sequence of {seq_len} tokens cannot be split over context_parallel={cp}: it needs a multiple of "
            f"2 x cp = {2 * cp} tokens (each rank holds two chunks). Pad or trim the sequences to a multiple of {2 * cp}."
        )
    size = seq_len // (2 * cp)
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat(
        [
            torch.arange(first * size, (first + 1) * size, device=device),
            torch.arange(second * size, (second + 1) * size, device=device),
        ]
    )


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of ``tensor`` along ``dim`` (its two load-balanced chunks, concatenated)."""
    index = local_positions(tensor.shape[dim], cp_rank, cp, tensor.device)
    return tensor.index_select(dim, index)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every cp rank's shard (in cp rank order), in global order."""
    cp = len(shards)
    halves = [piece for shard in shards for piece in shard.chunk(2, dim)]  # rank r: chunk r, then chunk 2cp-1-r
    order = [None] * (2 * cp)
    for rank in range(cp):
        first, second = chunk_ids(rank, cp)
        order[first], order[second] = halves[2 * rank], halves[2 * rank + 1]
    return torch.cat(order, dim)  # type: ignore[arg-type]


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim over ``group`` (cp rank order) in one tensor collective; backward: a
    reduce-scatter, each rank getting the sum of every rank's gradient for its own shard."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _moved(_all_gather(local, group), dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cp = dist.get_world_size(ctx.group)
        shape = list(grad.shape)
        shape[ctx.dim : ctx.dim + 1] = [cp, shape[ctx.dim] // cp]
        stacked = grad.reshape(shape).movedim(ctx.dim, 0).contiguous()  # (cp, ..., local tokens, ...)
        mine = stacked.new_empty(stacked.shape[1:])
        compat.reduce_scatter_single(mine, stacked.flatten(0, 1), group=ctx.group)
        return mine, None, None


def _all_gather(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(cp, *local.shape)``: every rank's ``local`` in cp rank order, by one ``all_gather_into_tensor``."""
    cp = dist.get_world_size(group)
    out = local.new_empty((cp * local.shape[0], *local.shape[1:]))
    compat.all_gather_single(out, local.contiguous(), group=group)
    return out.view(cp, *local.shape)


def _moved(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """``(cp, ...)`` -> the cp parts concatenated along ``dim`` of one part."""
    moved = stacked.movedim(0, dim)
    return moved.reshape(*moved.shape[:dim], -1, *moved.shape[dim + 2 :])


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every cp rank's shard of ``local`` concatenated along ``dim``, differentiable."""
    return _GatherSequence.apply(local, group, dim)


def _gathered_positions(seq_len: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of :func:`gather_sequence`'s output (cp rank order, each rank's two chunks)."""
    return torch.cat([local_positions(seq_len, r, cp, device) for r in range(cp)])


class _GatherTokens(torch.autograd.Function):
    """Per-token values (``(batch, local_tokens)``) of every cp rank, in the sequence's global order.

    For what every cp rank then computes alike (the loss's reduction over the whole sequence): each rank's
    upstream gradient is the same, so the backward keeps this rank's tokens and multiplies by cp, which the
    gradient mean over ``dp_shard x cp`` divides away again. No collective in the backward."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        seq_len = local.shape[1] * cp
        ctx.cp, ctx.index = cp, local_positions(seq_len, rank, cp, local.device)
        order = torch.argsort(_gathered_positions(seq_len, cp, local.device))
        return _moved(_all_gather(local, group), 1).index_select(1, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.index_select(1, ctx.index) * ctx.cp, None


def gather_tokens(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(batch, local_tokens)`` per-token values of every cp rank, as ``(batch, seq_len)`` in global order."""
    return _GatherTokens.apply(local, group)


def _window(window: int | None, seq_len: int, is_causal: bool, cp: int) -> int | None:
    """The sliding window to apply: None where there is none or it covers the whole sequence."""
    if window is None or window >= seq_len:
        return None
    if not is_causal:
        raise ContextParallelError(
            f"context_parallel={cp}: a bidirectional sliding window (sliding_window={window}) over {seq_len} tokens "
            "is not supported: Cuboid's context-parallel attention splits causal windows only. Use "
            "context_parallel=1, or sequences no longer than the window."
        )
    if window < 1:
        raise ContextParallelError(f"context_parallel={cp}: sliding_window={window} must be at least 1.")
    return window


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    seq_len: int,
    is_causal: bool = True,
    scale: float | None = None,
    enable_gqa: bool = False,
    key_padding: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries over every rank's keys and values.

    ``query``, ``key``, ``value``: ``(batch, heads, local_tokens, head_dim)``, this rank's load-balanced share of a
    sequence of ``seq_len`` tokens (``key``/``value`` may have fewer heads with ``enable_gqa``). The mask is
    causal on global positions (or none), and with ``key_padding`` (``(batch, seq_len)``, true where a token is
    real, in global order: the whole batch's ``attention_mask``) padding keys are masked out too. ``window``: a causal
    sliding window (transformers' ``sliding_window``: a query at ``q`` sees the keys ``q - window < k <= q``); one
    that covers the whole sequence changes nothing and is dropped. ``sink``: an attention sink's logit per query
    head (``(heads,)``: GPT-OSS's ``sinks``), one more key of value zero in every row's softmax. ``softcap``: the
    scores soft-capped before the softmax (``softcap * tanh(scores / softcap)``, Gemma 2's), computed as written
    (no fused kernel computes it; an ``Lq x S`` score matrix).

    Where the device has a kernel that returns its log-sum-exp (CPU; CUDA in bf16/fp16 without padding) and there
    is no dropout, this runs by blocks (:mod:`cuboid.context.blocks`: no ``Lq x S`` mask, half the causal work);
    elsewhere by one masked call.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    window = _window(window, seq_len, is_causal, cp)
    kernel = compat.lse_kernel(query, masked=key_padding is not None or window is not None, dropout_p=dropout_p)
    if kernel is not None and softcap is None:  # by blocks: no Lq x S mask (cuboid.context.blocks)
        chunks = chunk_ids(rank, cp)
        return block_attention(query, key, value, group, chunks, is_causal, scale, kernel, key_padding, window, sink)
    # One masked call over the gathered keys: dropout, or a device and dtype without a kernel that returns its
    # log-sum-exp (CUDA in float32, or with padding).
    keys, values = gather_sequence(key, group, 2), gather_sequence(value, group, 2)
    mask = None
    k_pos = _gathered_positions(seq_len, cp, query.device)
    if is_causal:
        q_pos = local_positions(seq_len, rank, cp, query.device)
        mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        if window is not None:
            mask &= q_pos.unsqueeze(1) - k_pos.unsqueeze(0) < window
    if key_padding is not None:
        real = key_padding.to(query.device, torch.bool).index_select(1, k_pos)[:, None, None, :]
        mask = real if mask is None else mask & real
    if softcap is not None:
        return _written_out(query, keys, values, mask, scale, dropout_p, sink, softcap)
    if sink is not None:
        return _with_sink(query, keys, values, mask, sink, scale, dropout_p)
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa, dropout_p=dropout_p
    )


def _per_query_head(keys: torch.Tensor, values: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys and values repeated to one per query head (as ``enable_gqa`` would), where they are fewer."""
    if keys.shape[1] == heads:
        return keys, values
    return keys.repeat_interleave(heads // keys.shape[1], dim=1), values.repeat_interleave(heads // values.shape[1], 1)


def _with_sink(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """The one masked call with an attention sink: one more key, all zeros, whose additive mask is the sink's logit
    per head (its score ``q . 0 + sink``) and whose value is zero; the sink's gradient flows through that mask."""
    batch, heads, rows = query.shape[:3]
    keys, values = _per_query_head(keys, values, heads)  # the extra key is per query head
    zero = keys.new_zeros((batch, heads, 1, keys.shape[-1]))
    keys, values = torch.cat([keys, zero], 2), torch.cat([values, zero.expand(-1, -1, -1, values.shape[-1])], 2)
    bias = torch.zeros((batch, heads, rows, keys.shape[2] - 1), dtype=query.dtype, device=query.device)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    column = sink.to(query.dtype).view(1, heads, 1, 1).expand(batch, heads, rows, 1)
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=torch.cat([bias, column], -1), scale=scale, dropout_p=dropout_p
    )


def _written_out(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    dropout_p: float,
    sink: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:
    """Attention as transformers' eager function writes it, for soft-capped scores: ``q k^T`` scaled, soft-capped,
    masked (the dtype's minimum, as transformers' masks hold), a sink's column if any, softmax in float32."""
    heads = query.shape[1]
    keys, values = _per_query_head(keys, values, heads)
    scores = query @ keys.transpose(-1, -2) * (scale if scale is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sink is not None:
        scores = torch.cat([scores, sink.to(scores.dtype).view(1, heads, 1, 1).expand(*scores.shape[:3], 1)], -1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sink is not None:
        probs = probs[..., :-1]
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ values
