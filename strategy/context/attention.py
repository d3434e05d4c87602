"""Context parallel's exact attention: each cp rank holds a load-balanced share of every sequence's tokens.

A sequence of ``S`` tokens is cut into ``2 x cp`` equal chunks; cp rank ``i`` holds chunks ``i`` and
``2 cp - 1 - i``, so under a causal mask every rank carries the same amount of work (no rank holds the long end of
the triangle alone). Attention over the whole sequence is exact: each rank gathers every rank's keys and values
over the cp group (one ``all_gather_into_tensor`` in forward, of the model's own key/value heads: a grouped-query
model's are not repeated first; its backward sums each chunk's key and value gradients back to the rank that holds
it with one ``reduce_scatter_tensor``, half an all-reduce's bytes), and masks by the tokens' *global* positions, block by block (:mod:`cuboid.context.blocks`). Equal to full attention up
to float32 round-off (``tests/context/test_context_parallel.py``).

One path on every device: only the fused kernel each block calls differs (:func:`cuboid.compat.lse_kernel`: CPU's
flash kernel, FlashAttention-2 or the memory-efficient kernel on a GPU), and a case no kernel computes is refused by
name. :func:`gather_tokens` brings per-token values (a loss before its reduction) back in global order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

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
    """Exact attention of this rank's queries over every rank's keys and values, by blocks
    (:mod:`cuboid.context.blocks`: no ``Lq x S`` tensor on any device, half the causal work).

    ``query``, ``key``, ``value``: ``(batch, heads, local_tokens, head_dim)``, this rank's load-balanced share of a
    sequence of ``seq_len`` tokens (``key``/``value`` may have fewer heads with ``enable_gqa``). The mask is
    causal on global positions (or none), and with ``key_padding`` (``(batch, seq_len)``, true where a token is
    real, in global order: the whole batch's ``attention_mask``) padding keys are masked out too. ``window``: a causal
    sliding window (transformers' ``sliding_window``: a query at ``q`` sees the keys ``q - window < k <= q``); one
    that covers the whole sequence changes nothing and is dropped. ``sink``: an attention sink's logit per query
    head (``(heads,)``: GPT-OSS's ``sinks``), one more key of value zero in every row's softmax. ``softcap``: the
    scores soft-capped before the softmax (``softcap * tanh(scores / softcap)``, Gemma 2's). A case no kernel of
    this device computes with its log-sum-exp (attention dropout, an unsupported dtype or head dim) is a
    :class:`ContextParallelError` that names it.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    window = _window(window, seq_len, is_causal, cp)
    kernel = attention_kernel(query, cp, key_padding is not None, softcap is not None, dropout_p)
    chunks = chunk_ids(rank, cp)
    return block_attention(
        query, key, value, group, chunks, is_causal, scale, kernel, key_padding, window, sink, softcap
    )


def attention_kernel(query: torch.Tensor, cp: int, padded: bool, softcap: bool, dropout_p: float = 0.0) -> str:
    """The block kernel for ``query`` (:func:`cuboid.compat.lse_kernel`), or a :class:`ContextParallelError` that says
    why there is none and what to do."""
    try:
        return compat.lse_kernel(query, padded=padded, softcap=softcap, dropout_p=dropout_p)
    except compat.KernelUnavailable as err:
        raise ContextParallelError(
            f"context_parallel={cp} cannot split this attention: {err}. Cuboid's context-parallel attention runs by "
            "blocks merged by their log-sum-exp, on every device. Train without attention dropout "
            "(attention_dropout=0.0), in bf16-mixed or fp32 with a head dim in multiples of 8, or use "
            "context_parallel=1."
        ) from None


def check_attention(model: Any, cp: int) -> None:
    """Refuse at setup, by name, what no block kernel computes on any device (each kernel returns its blocks'
    log-sum-exp: :func:`cuboid.compat.lse_kernel`): attention dropout, and a head dim not in multiples of 8, from a
    transformers config or Cuboid's own (``cfg``). The first step checks the rest (dtype, device)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dropout = float(getattr(text, "attention_dropout", 0.0) or 0.0)
    head_dim = getattr(text, "head_dim", None)
    if text is not None and head_dim is None and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    if head_dim is None:
        head_dim = getattr(getattr(model, "cfg", None), "head_dim", None)
    if dropout:
        raise ContextParallelError(
            f"context_parallel={cp} cannot split {type(model).__name__}: its attention_dropout={dropout} has no block "
            "kernel that returns the log-sum-exp on any device (torch's CPU kernel takes no dropout, and a dropout "
            "mask per block would have to be made again in the backward). Set config.attention_dropout=0.0 (what "
            "LLM training uses), or use context_parallel=1."
        )
    if isinstance(head_dim, int) and head_dim % 8:
        raise ContextParallelError(
            f"context_parallel={cp} cannot split {type(model).__name__}: its head dim {head_dim} is not a multiple of "
            "8, which FlashAttention and the memory-efficient kernel need for the blocks Cuboid runs on a GPU (the "
            "CPU would run it, but no GPU could). Use a head dim in multiples of 8, or context_parallel=1."
        )
