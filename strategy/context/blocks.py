"""Context parallel's attention by blocks: no ``Lq x S`` mask, and only the causal half of the work.

cp rank ``r`` holds query chunks ``r`` and ``2 cp - 1 - r`` (each ``c = S / 2 cp`` tokens). Under a causal mask a
query chunk ``g`` sees the keys of chunks ``0 .. g - 1`` whole and its own chunk ``g`` up to the diagonal, so
each query chunk is two kernel calls: one over the keys ``[0, g c)`` with no mask, one over ``[g c, (g + 1) c)``
with ``is_causal``. Their outputs are merged by their log-sum-exp (``out = sum_i exp(lse_i - lse) out_i``,
``lse = logaddexp(lse_i)``), which is exact. The backward runs each block's kernel backward with the merged
output and log-sum-exp (FlashAttention's own backward, block by block) and sums the gradients.

Keys and values arrive from one all-gather of the model's own key/value heads (both in one collective; a
grouped-query model's are not repeated) and are laid out in global order, so each block is a slice. Only this
rank's keys and values are kept for backward, which gathers them again: the whole sequence's keys and values live
while one layer's attention runs, not from its forward to its backward (saved activations fall as 1/cp; the
price is a second all-gather per layer). Their gradients go back to the ranks that hold them with one
reduce-scatter.

Padding (a ``(batch, S)`` ``attention_mask``): each block is handed its keys' share of it (``batch x keys``
booleans, never ``Lq x S``) and its kernel applies it (a block's own small additive mask on CPU, the
memory-efficient kernel's bias on a GPU). A row whose keys in a block are all padding (left padding, or a padding
query) gets a log-sum-exp of ``-inf`` there, so the merge gives it no weight; a row with no real key at all comes
out as zeros, as ``scaled_dot_product_attention`` gives it.

A sliding window ``w`` shorter than the sequence (a query at ``q`` sees the keys ``q - w < k <= q``, transformers'
``sliding_window``) cuts each query chunk's keys into the blocks every row sees whole (no mask), one block at the
window's lower edge and the diagonal, and none outside the window. A windowed block is stated as FlashAttention's
own ``(left, right)`` window, which a GPU's flash kernel takes as it is and the other kernels as a ``rows x keys``
mask made once for the plan (``chunk x (chunk + w - 1)`` at most, a window no longer than a chunk being one block).

Above the kernel call everything here is the same on every device: the plan, the slices, the merges, the rows that
see no key, the exchange. :func:`cuboid.compat.lse_kernel` picks the kernel for the device, dtype and case.

An attention sink (a learned logit per head that joins every row's softmax with a value of zero: GPT-OSS) is one
more block merged last, its log-sum-exp the sink's logit and its output zero. The blocks' backward then sees the
probabilities of the softmax with the sink, and the sink's gradient is ``-p_sink * rowsum(dO * O)`` summed over
the rows.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from cuboid import compat

# (first key, end key, what its rows see of it beside the padding)
Block = tuple[int, int, compat.BlockShape]


def _chunk_order(cp: int) -> list[tuple[int, int]]:
    """``(rank, half)`` of each global chunk ``0 .. 2 cp - 1``: rank ``r`` holds chunk ``r`` first and
    ``2 cp - 1 - r`` second."""
    return [(g, 0) for g in range(cp)] + [(2 * cp - 1 - g, 1) for g in range(cp, 2 * cp)]


def _gather_kv(key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    """Every cp rank's keys and values (``(batch, kv heads, 2 c, dim)`` each) as the whole sequence in global
    order: one all-gather of both, one copy."""
    cp = dist.get_world_size(group)
    local = torch.stack([key, value])  # (2, batch, heads, 2c, dim)
    stacked = local.new_empty((cp * 2, *local.shape[1:]))
    compat.all_gather_single(stacked, local, group=group)
    stacked = stacked.view(cp, *local.shape)
    c = local.shape[3] // 2
    pieces = [stacked[rank, :, :, :, half * c : (half + 1) * c] for rank, half in _chunk_order(cp)]
    whole = torch.cat(pieces, dim=3)
    return whole[0], whole[1]


def _scatter_kv(dk: torch.Tensor, dv: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    """The whole sequence's key and value gradients summed over cp ranks, each rank getting its own two chunks':
    one reduce-scatter of both."""
    cp = dist.get_world_size(group)
    batch, heads, seq_len, dim = dk.shape
    c = seq_len // (2 * cp)
    stacked = dk.new_empty((cp, 2, batch, heads, 2 * c, dim))
    for g, (rank, half) in enumerate(_chunk_order(cp)):
        stacked[rank, 0, :, :, half * c : (half + 1) * c] = dk[:, :, g * c : (g + 1) * c]
        stacked[rank, 1, :, :, half * c : (half + 1) * c] = dv[:, :, g * c : (g + 1) * c]
    mine = dk.new_empty((2, batch, heads, 2 * c, dim))
    compat.reduce_scatter_single(mine, stacked.flatten(0, 1), group=group)
    return mine[0], mine[1]


@functools.lru_cache(maxsize=64)  # the same plan for every layer and step: its window masks made once
def plan_blocks(
    chunks: tuple[int, int], chunk: int, seq_len: int, is_causal: bool, window: int | None = None,
    device: torch.device | None = None,
) -> list[list[Block]]:  # fmt: skip
    """For each of this rank's two query chunks, the key blocks it attends to (``window``: causal sliding window, a
    query at ``q`` seeing the keys ``q - window < k <= q``). Every block is one FlashAttention call on a GPU: a
    windowed block is stated as FlashAttention's own bottom-right aligned ``(left, right)`` window
    (:class:`cuboid.compat.BlockShape`), which is why a window longer than a chunk starts its edge block one key
    into the keys every row sees (a block whose lowest row's edge falls below its first key cannot be stated so).
    Cached: the masks it holds are shared by every call with the same arguments and must not be written to."""
    if not is_causal:  # every key, a chunk at a time: no kernel makes a rows x (whole sequence) tensor
        return [[(j * chunk, (j + 1) * chunk, compat.BlockShape()) for j in range(seq_len // chunk)] for _ in chunks]
    plans = []
    for g in chunks:
        first, end = g * chunk, (g + 1) * chunk
        whole = end - window if window is not None else -1  # below ``whole + 1`` a row of the chunk misses a key
        blocks: list[Block] = []
        if window is not None and window <= chunk:  # one block: the window's keys of the whole chunk
            start = max(0, first - window + 1)
            blocks.append((start, end, _windowed(chunk, end - start, window - 1, 0, device)))
        else:
            if whole >= 0:  # the window's lower edge: row i sees the block's keys from its i-th on
                start = max(0, first - window + 1)  # type: ignore[operator]
                blocks.append((start, whole + 1, _windowed(chunk, whole + 1 - start, 0, window - 1, device)))  # type: ignore[operator]
            if max(whole + 1, 0) < first:  # every row sees these whole
                blocks.append((max(whole + 1, 0), first, compat.BlockShape()))
            blocks.append((first, end, compat.BlockShape(causal=True)))
        plans.append(blocks)
    return plans


def _windowed(rows: int, keys: int, left: int, right: int, device: torch.device | None) -> compat.BlockShape:
    return compat.BlockShape(window=(left, right), visible=compat.window_mask(rows, keys, left, right, device))


def _dead(real: torch.Tensor | None, block: Block, rows: int) -> torch.Tensor | None:
    """Rows with no visible real key in ``block`` (their log-sum-exp there becomes ``-inf``): ``(batch, 1, 1)`` for
    a whole block, ``(batch, 1, rows)`` for a causal or windowed one (causal: row ``j`` sees the block's keys
    ``0 .. j``); None when every row sees one."""
    start, end, shape = block
    if shape.visible is not None:
        seen = shape.visible[None] if real is None else shape.visible[None] & real[:, None, start:end]
        return ~seen.any(-1)[:, None, :]
    if real is None:
        return None
    keys = real[:, start:end]
    if shape.causal:
        return (keys.cumsum(-1) == 0)[:, None, :]
    return ~keys.any(-1)[:, None, None]


def _own(tensor: torch.Tensor, rows: slice) -> torch.Tensor:
    """``rows`` of ``tensor`` (along dim 2) as a tensor of their own. Each kernel's backward takes its rows' output
    gradient, output and log-sum-exp so: FlashAttention's reads the log-sum-exp through its raw pointer as a
    contiguous ``(batch, heads, rows)`` tensor, and a slice of the whole ``(batch, heads, 2 chunk)`` one is not (every
    row but the first would read another row's; :mod:`cuboid.compat.contracts`)."""
    return tensor[:, :, rows].contiguous()


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same rows over disjoint keys -> their attention over the union (a row with
    no key in either stays zero)."""
    wide = torch.promote_types(block_out.dtype, torch.float32)
    if out is None or lse is None:
        return block_out.to(wide), block_lse
    merged = torch.logaddexp(lse, block_lse)
    safe = merged.masked_fill(merged == float("-inf"), 0.0)
    return (
        out * torch.exp(lse - safe).unsqueeze(-1).to(wide)
        + block_out.to(wide) * torch.exp(block_lse - safe).unsqueeze(-1).to(wide),
        merged,
    )


def _sink_lse(sink: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """An attention sink's logit per head (``(heads,)``) as a log-sum-exp shaped ``like`` (batch, heads, rows)."""
    return sink.to(like.dtype).view(1, -1, 1).expand_as(like)


class _Blocks(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        group: dist.ProcessGroup,
        plan: list[list[Block]],
        scale: float | None,
        kernel: str,
        real: torch.Tensor | None,
        sink: torch.Tensor | None,
        softcap: float | None,
    ) -> torch.Tensor:
        keys, values = _gather_kv(key, value, group)
        chunk = query.shape[2] // len(plan)
        outs, lses, saved = [], [], []
        for half, blocks in enumerate(plan):
            rows = query[:, :, half * chunk : (half + 1) * chunk]
            out = lse = None
            for block in blocks:
                start, end, shape = block
                mine = real[:, start:end] if real is not None else None
                block_out, block_lse, extra = compat.lse_attention(
                    kernel, rows, keys[:, :, start:end], values[:, :, start:end], shape, mine, scale, softcap
                )
                dead = _dead(real, block, chunk)
                if dead is not None:
                    block_lse = block_lse.masked_fill(dead, float("-inf"))
                out, lse = _merge(out, lse, block_out, block_lse)
                saved.append(extra)
            assert out is not None and lse is not None
            if sink is not None:  # one more key per head: its logit the sink's, its value zero
                out, lse = _merge(out, lse, torch.zeros_like(out), _sink_lse(sink, lse))
            outs.append(out.to(query.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(query, key, value, out, lse, sink, real)  # this rank's K and V only: gathered again
        ctx.group, ctx.plan, ctx.scale, ctx.kernel, ctx.saved, ctx.softcap = group, plan, scale, kernel, saved, softcap
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, sink, real = ctx.saved_tensors
        keys, values = _gather_kv(key, value, ctx.group)
        chunk = query.shape[2] // len(ctx.plan)
        # A row with no real key: its output is a constant zero; +inf makes each block's probabilities 0 there.
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(keys), torch.zeros_like(values)
        extras = iter(ctx.saved)
        for half, blocks in enumerate(ctx.plan):
            rows = slice(half * chunk, (half + 1) * chunk)
            q, g, o, row_lse = query[:, :, rows], _own(grad, rows), _own(out, rows), _own(lse, rows)
            for start, end, shape in blocks:
                mine = real[:, start:end] if real is not None else None
                dq_b, dk_b, dv_b = compat.lse_attention_backward(
                    ctx.kernel, g, q, keys[:, :, start:end], values[:, :, start:end], o, row_lse, shape, mine,
                    ctx.scale, next(extras), ctx.softcap,
                )  # fmt: skip
                dq[:, :, rows] += dq_b
                dk[:, :, start:end] += dk_b
                dv[:, :, start:end] += dv_b
        dk, dv = _scatter_kv(dk, dv, ctx.group)
        dsink = None
        if sink is not None:  # the sink's probability times the gradient of its logit: -p_sink * rowsum(dO * O)
            rows = (grad.float() * out.float()).sum(-1)
            dsink = -(torch.exp(_sink_lse(sink, lse) - lse) * rows).sum((0, 2)).to(sink.dtype)
        return dq, dk, dv, None, None, None, None, None, dsink, None


@torch.compiler.disable  # eager inside compiled blocks: collectives and aten kernel calls, nothing to fuse
def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    chunks: tuple[int, int],
    is_causal: bool,
    scale: float | None,
    kernel: str,
    key_padding: torch.Tensor | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """This rank's queries (chunks ``chunks``) over every rank's keys and values, block by block (see the module
    docstring), each block with ``kernel`` (:func:`cuboid.compat.lse_kernel`). ``key_padding``: ``(batch, S)``, true
    where a token is real, in global order; ``window``: a causal sliding window (a query at ``q`` sees the keys
    ``q - window < k <= q``); ``sink``: an attention sink's logit per query head (``(heads,)``, GPT-OSS's ``sinks``),
    one more key of value zero in every row's softmax; ``softcap``: scores soft-capped (``softcap * tanh(s /
    softcap)``, Gemma 2's)."""
    chunk = query.shape[2] // 2
    seq_len = chunk * 2 * dist.get_world_size(group)
    real = key_padding.to(query.device, torch.bool) if key_padding is not None else None
    plan = plan_blocks(chunks, chunk, seq_len, is_causal, window, query.device)
    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if v_dim == qk_dim:
        return _Blocks.apply(query, key, value, group, plan, scale, kernel, real, sink, softcap)
    # A value head dim unlike the query's (DeepSeek-V3's MLA: 192 / 128): the smaller side padded with zeros to the
    # larger, which no score and no output column changes (zero value columns give zero output columns; zero query
    # and key columns add nothing to a score, the scale kept the unpadded one), so keys and values gather in one
    # collective and every kernel takes equal head dims (FlashAttention and torch's CPU kernel require them;
    # transformers pads the value the same way for FlashAttention).
    scale = qk_dim**-0.5 if scale is None else scale
    if v_dim < qk_dim:
        value = torch.nn.functional.pad(value, (0, qk_dim - v_dim))
    else:
        query, key = (torch.nn.functional.pad(t, (0, v_dim - qk_dim)) for t in (query, key))
    out = _Blocks.apply(query, key, value, group, plan, scale, kernel, real, sink, softcap)
    return out[..., :v_dim]
