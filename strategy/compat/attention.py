"""Attention kernels that also return each row's log-sum-exp, which ``F.scaled_dot_product_attention`` keeps to
itself: what merging attention over blocks of keys needs (context parallel's blocks, ``cuboid.context.blocks``).
torch's own ring attention calls the same aten ops; no public API returns the log-sum-exp. Pinned in
``tests/test_compat.py`` (every op's schema, the CPU kernels' values against autograd) and checked on CPU against
the CUDA kernels' own preconditions by :mod:`cuboid.compat.contracts`.

Everything above the kernel call is the same on every device: the caller hands each block's rows, keys and values,
its shape (:class:`BlockShape`: causal on the diagonal, a sliding window, the window's visible keys), and which of its
keys are real (padding); the kernel returns ``(out, lse, saved)`` and, given the *merged* output and log-sum-exp of
the whole row, the block's gradients (FlashAttention's own backward, block by block). Only the call differs:

- ``"cpu_flash"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward. Any float dtype,
  grouped-query heads as they come, the window and the padding as one additive mask of the block's own
  (``(batch, 1, rows, keys)`` at most).
- ``"cuda_flash"``: ``aten._flash_attention_forward`` / ``_flash_attention_backward`` (FlashAttention-2, bf16 and
  fp16, head dims up to 256 in multiples of 8, grouped-query heads as they come), the window as FlashAttention's own
  ``window_size_left`` / ``window_size_right`` (bottom-right aligned, as :class:`BlockShape` states it), where it
  reads them as :class:`BlockShape` does (:func:`flash_reads_as_ours`; a block it would read otherwise, a window's
  lower edge with more rows than keys + 1, takes ``cuda_efficient`` with its mask). It takes no mask: a batch with
  padding takes ``cuda_efficient``. Chosen where torch's ``scaled_dot_product_attention`` would
  choose flash (torch 2.11's ``sdp_utils.cpp``: no mask, fp16/bf16, head dim at most 256).
- ``"cuda_efficient"``: ``aten._efficient_attention_forward`` / ``_efficient_attention_backward`` (the memory-efficient
  kernel: fp32 too, any head dim in multiples of 8, or 4 in fp32), with the block's own small bias (the padding, and
  the window where there is one) laid out as the kernel wants it (exact ``(batch, heads, rows, keys)`` sizes by
  ``expand``, rows padded to a multiple of 8); grouped-query keys repeated to one per query head for the block
  (torch 2.11 and 2.13's kernel takes equal head counts only). What ``scaled_dot_product_attention`` picks for a mask
  or fp32.
- ``"cpu_softcap"`` / ``"cuda_flex"``: soft-capped scores (Gemma 2's ``softcap * tanh(scores / softcap)``), which no
  flash or memory-efficient kernel of torch computes. On CPU, written out for the block (``rows x keys`` scores) with
  its backward by hand; on CUDA, FlexAttention compiled (a fused kernel) with the soft-cap as its ``score_mod``, its
  backward by recomputing the block under autograd with the gradients of its output and log-sum-exp that the merge
  gives (:func:`_backward_by_recompute`, checked on CPU with the written-out forward).

Dropout in attention has no kernel here on any device (the CPU kernel has none; a block-by-block dropout would need
each block's mask again in the backward): the caller refuses it, by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from cuboid.compat.softcap import (
    _backward_by_recompute,
    _flex_call,
    _per_kv_head,
    _per_query_head,
    _softcapped,
    _softcapped_backward,
)

aten = torch.ops.aten
KERNELS = ("cpu_flash", "cpu_softcap", "cuda_flash", "cuda_efficient", "cuda_flex")
INF = float("inf")


class KernelUnavailable(ValueError):
    """No fused kernel computes this attention on this device; the message says why (the caller says what to do)."""


@dataclass(frozen=True)
class BlockShape:
    """What of a block of keys its rows see, beside the padding. ``causal``: the diagonal block (rows and keys the
    same span), each row its own key and the ones before. ``window``: ``(left, right)`` as FlashAttention states a
    local window, bottom-right aligned: row ``i`` of ``rows`` sees key ``j`` of ``keys`` when ``i + keys - rows - left
    <= j <= i + keys - rows + right`` (``None``: no bound on that side). ``visible``: that window as a ``(rows, keys)``
    boolean mask, made once for the plan (the kernels that take a mask read it; the caller finds rows that see no key
    with it)."""

    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    visible: torch.Tensor | None = None


def window_mask(rows: int, keys: int, left: int | None, right: int | None, device: Any = None) -> torch.Tensor:
    """``(rows, keys)``, true where row ``i`` sees key ``j`` under a bottom-right aligned window (:class:`BlockShape`)."""
    offset = torch.arange(keys, device=device)[None, :] - torch.arange(rows, device=device)[:, None] - (keys - rows)
    seen = torch.ones(rows, keys, dtype=torch.bool, device=device)
    if left is not None:
        seen &= offset >= -left
    if right is not None:
        seen &= offset <= right
    return seen


Window = tuple[int | None, int | None] | None


def flash_window(rows: int, keys: int, causal: bool, window: Window, backward: bool = False) -> tuple[int, int]:
    """The ``(left, right)`` window FlashAttention-2 applies to a block of ``rows`` queries and ``keys`` keys, given
    ours (``None``: no bound, which torch's ``_flash_attention_forward`` passes as ``value_or(-1)``), normalised as
    torch's copy of it does (``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``): ``mha_fwd`` sets
    a bound ``>= seqlen_k`` to -1, then causal off for one query row, then ``window_size_right = 0`` for causal
    (``mha_bwd``: causal first, no one-row rule); ``set_params_fprop`` then sets a -1 bound to ``seqlen_k`` where
    the other one is set. (-1, -1): no mask."""
    left, right = window or (None, None)
    left, right = -1 if left is None else left, -1 if right is None else right
    if backward and causal:
        right = 0
    left, right = -1 if left >= keys else left, -1 if right >= keys else right
    if causal and rows > 1 and not backward:
        right = 0
    if left < 0 and right >= 0:
        left = keys
    if left >= 0 and right < 0:
        right = keys
    return left, right


def flash_visible(rows: int, keys: int, causal: bool, window: Window, backward: bool = False) -> torch.Tensor:
    """``(rows, keys)``: the keys FlashAttention-2 lets each row see (``flash_attn/mask.h``, ``apply_mask_local``:
    ``col >= max(0, row + seqlen_k - seqlen_q - window_size_left)`` and ``col < min(seqlen_k, row + 1 + seqlen_k -
    seqlen_q + window_size_right)``; ``apply_mask_causal`` is its ``window_size_right = 0`` case)."""
    left, right = flash_window(rows, keys, causal, window, backward)
    if left < 0 and right < 0:
        return torch.ones(rows, keys, dtype=torch.bool)
    row, col = torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    return (col >= (row + keys - rows - left).clamp(min=0)) & (col < (row + 1 + keys - rows + right).clamp(max=keys))


@functools.lru_cache(maxsize=256)
def flash_reads_as_ours(rows: int, keys: int, causal: bool, window: Window) -> bool:
    """Whether FlashAttention-2's forward and backward see exactly the keys :class:`BlockShape` states for this
    block. Not always: a bound it normalises to ``seqlen_k`` (:func:`flash_window`) is stricter than ours when a
    block has more rows than keys + 1 (a window's lower-edge block near the sequence's start: its first rows lose
    keys, and a row left with none gets a log-sum-exp of +inf, ``flash_attn/softmax.h`` ``normalize_softmax_lse``).
    Decided on the host from the block's sizes alone (row by row, each row's first and last key; no tensor), once
    per plan."""
    left, right = (None, 0) if causal else (window or (None, None))
    shift = keys - rows

    def span(i: int, low: float, high: float) -> tuple[int, int] | None:
        first, last = max(0, int(max(low, -keys))), min(keys - 1, int(min(high, 2 * keys)))
        return (first, last) if first <= last else None

    inf = float("inf")
    ours = [span(i, i + shift - (inf if left is None else left), i + shift + (inf if right is None else right))
            for i in range(rows)]  # fmt: skip
    for backward in (False, True):
        fl, fr = flash_window(rows, keys, causal, window, backward)
        if fl < 0 and fr < 0:
            theirs = [span(i, 0, keys - 1) for i in range(rows)]
        else:  # mask.h: col >= row + shift - left, col < row + 1 + shift + right
            theirs = [span(i, i + shift - fl, i + shift + fr) for i in range(rows)]
        if theirs != ours:
            return False
    return True


def block_kernel(kernel: str, shape: BlockShape, rows: int, keys: int) -> str:
    """The kernel a block runs with: ``kernel``, except that a block FlashAttention-2 would read otherwise than
    ``shape`` (:func:`flash_reads_as_ours`) takes the memory-efficient kernel with the block's own mask."""
    if kernel == "cuda_flash" and not flash_reads_as_ours(rows, keys, shape.causal, shape.window):
        return "cuda_efficient"
    return kernel


def lse_kernel(query: torch.Tensor, padded: bool = False, softcap: bool = False, dropout_p: float = 0.0) -> str:
    """The kernel that runs attention blocks of ``query``'s device, dtype and head dim with their log-sum-exp
    (``padded``: some keys are padding; ``softcap``: soft-capped scores), or :class:`KernelUnavailable` naming why
    there is none."""
    if dropout_p:
        raise KernelUnavailable(
            f"attention dropout (dropout_p={dropout_p}) has no block kernel that returns the log-sum-exp on any device "
            "(torch's CPU kernel takes none, and a dropout mask per block would have to be made again in the backward)"
        )
    device, dtype, head_dim = query.device.type, query.dtype, query.shape[-1]
    if device == "cpu":
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise KernelUnavailable(f"{dtype} attention on CPU: torch's CPU flash kernel takes float dtypes only")
        return "cpu_softcap" if softcap else "cpu_flash"
    if device != "cuda":
        raise KernelUnavailable(f"no attention kernel that returns the log-sum-exp is known for {device} devices")
    if softcap:
        return "cuda_flex"
    half = dtype in (torch.bfloat16, torch.float16)
    if half and not padded and head_dim <= 256 and head_dim % 8 == 0:
        return "cuda_flash"
    if (half and head_dim % 8 == 0) or (dtype == torch.float32 and head_dim % 4 == 0):
        return "cuda_efficient"
    raise KernelUnavailable(
        f"{dtype} attention with head dim {head_dim} on CUDA: FlashAttention takes bf16/fp16 with a head dim of at most "
        "256 in multiples of 8, the memory-efficient kernel bf16/fp16/fp32 with a head dim in multiples of 8 (4 in "
        "fp32), and torch's math kernel returns no log-sum-exp"
    )


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """``(batch, heads, tokens, dim)`` -> the ``(batch, tokens, heads, dim)`` view the CUDA kernels take."""
    return t.transpose(1, 2)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _additive(shape: BlockShape, real: torch.Tensor | None, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The block's window and padding as an additive mask: ``(batch, 1, rows or 1, keys)``, or ``(rows, keys)``
    without padding; None without either."""
    window = None if shape.visible is None else _window_bias(shape.visible, dtype)
    if real is None:
        return window
    pad = torch.zeros(real.shape, dtype=dtype, device=real.device).masked_fill(~real, -INF)[:, None, None, :]
    return pad if window is None else pad + window


@functools.lru_cache(maxsize=64)
def _window_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A window's visible keys as an additive ``(rows, keys)`` mask, made once per plan and dtype (not written to)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, -INF)


def _efficient_bias(shape: BlockShape, real: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """The memory-efficient kernel's ``attn_bias`` for a block: exact ``(batch, heads, rows, keys)`` sizes (broadcast
    dims by ``expand``: stride 0), the query's dtype, its own storage (16-byte aligned) with the last dim contiguous
    and every other stride a multiple of 8 (rows padded to a multiple of 8 keys), as ``_efficient_attention_forward``
    checks (torch 2.11, 2.13: ``attention.cu``, ``kernel_forward.h`` ``check_supported``)."""
    if real is None and shape.visible is None:
        return None
    batch, heads, rows = query.shape[:3]
    keys = real.shape[-1] if real is not None else shape.visible.shape[-1]  # type: ignore[union-attr]
    bias = torch.zeros(
        real.shape[0] if real is not None else 1, 1, rows if shape.visible is not None else 1, _round_up(keys, 8),
        dtype=query.dtype, device=query.device,
    )  # fmt: skip
    part = bias[..., :keys]
    if shape.visible is not None:
        part.masked_fill_(~shape.visible, -INF)
    if real is not None:
        part.masked_fill_(~real[:, None, None, :], -INF)
    return part.expand(batch, heads, rows, keys)


def lse_attention(
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shape: BlockShape,
    real: torch.Tensor | None,
    scale: float | None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``(out, lse, saved)``: attention of ``query`` over ``key``/``value`` (``(batch, heads, tokens, head_dim)``; fewer
    key/value heads for grouped-query attention) within ``shape``, the keys where ``real`` (``(batch, keys)``) is false
    left out; each row's log-sum-exp ``(batch, heads, rows)`` (float32, or float64 for float64 inputs) and what
    :func:`lse_attention_backward` needs. A row that sees no key has an output of zeros and a log-sum-exp the caller
    overrides (each kernel writes its own: 0, or +inf)."""
    rows = query.shape[2]
    kernel = block_kernel(kernel, shape, rows, key.shape[2])
    if kernel == "cpu_flash":
        mask = _additive(shape, real, rows, query.dtype)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, shape.causal, attn_mask=mask, scale=scale
        )
        return out, lse, ()
    if kernel == "cuda_flash":
        if real is not None:
            raise ValueError("cuda_flash takes no padding mask: lse_kernel gives cuda_efficient for one")
        left, right = shape.window or (None, None)
        out, lse, rng, unused, _ = aten._flash_attention_forward(
            _bshd(query), _bshd(key), _bshd(value), None, None, rows, key.shape[2], 0.0, shape.causal, False,
            scale=scale, window_size_left=left, window_size_right=right,
        )  # fmt: skip
        return out.transpose(1, 2), lse, (rng, unused)
    if kernel == "cuda_efficient":
        heads = query.shape[1]
        bias = _efficient_bias(shape, real, query)
        k, v = _per_query_head(key, heads), _per_query_head(value, heads)
        out, lse, seed, offset, _, _ = aten._efficient_attention_forward(
            _bshd(query), _bshd(k), _bshd(v), bias, None, None, rows, k.shape[2], 0.0, int(shape.causal), True,
            scale=scale,
        )  # fmt: skip
        return out.transpose(1, 2), lse[..., :rows], (seed, offset)
    if kernel == "cpu_softcap":
        assert softcap is not None
        out, lse = _softcapped(query, key, value, shape, real, scale, softcap)
        return out, lse, ()
    if kernel == "cuda_flex":
        assert softcap is not None
        out, lse = _flex_call(query, key, value, shape, real, scale, softcap)
        return out, lse, ()
    raise ValueError(f"unknown attention kernel {kernel!r}")


def lse_attention_backward(
    kernel: str,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    shape: BlockShape,
    real: torch.Tensor | None,
    scale: float | None,
    saved: tuple,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``query``, ``key`` and ``value`` for one block, given the whole row's ``out`` and ``lse``
    (``(batch, heads, rows)``, contiguous, float32: FlashAttention's backward reads it through its raw pointer)."""
    rows = query.shape[2]
    kernel = block_kernel(kernel, shape, rows, key.shape[2])  # (the forward's choice: the same sizes)
    if kernel == "cpu_flash":
        mask = _additive(shape, real, rows, query.dtype)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, shape.causal, attn_mask=mask, scale=scale
        )
    if kernel == "cuda_flash":
        rng, unused = saved
        left, right = shape.window or (None, None)
        dq, dk, dv = aten._flash_attention_backward(
            _bshd(grad_out), _bshd(query), _bshd(key), _bshd(value), _bshd(out), lse, None, None, rows, key.shape[2],
            0.0, shape.causal, rng, unused, scale=scale, window_size_left=left, window_size_right=right,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if kernel == "cuda_efficient":
        seed, offset = saved
        heads = query.shape[1]
        bias = _efficient_bias(shape, real, query)
        k, v = _per_query_head(key, heads), _per_query_head(value, heads)
        # the kernel reads its log-sum-exp padded to 32 rows (+inf past the rows), and ``out`` as a (batch, rows,
        # heads, dim) buffer of its own (a row stride of heads x dim, not checked: kernel_backward.h ``o_strideM``)
        padded = lse.new_full((*lse.shape[:2], _round_up(rows, 32)), INF)
        padded[..., :rows] = lse
        dq, dk, dv, _ = aten._efficient_attention_backward(
            _bshd(grad_out), _bshd(query), _bshd(k), _bshd(v), bias, _bshd(out).contiguous(), None, None, rows,
            k.shape[2], padded, 0.0, seed, offset, int(shape.causal), False, scale=scale,
        )  # fmt: skip
        dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
        return dq.transpose(1, 2), _per_kv_head(dk, key.shape[1]), _per_kv_head(dv, value.shape[1])
    if kernel == "cpu_softcap":
        assert softcap is not None
        return _softcapped_backward(grad_out, query, key, value, out, lse, shape, real, scale, softcap)
    if kernel == "cuda_flex":
        assert softcap is not None

        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return _flex_call(q, k, v, shape, real, scale, softcap)

        return _backward_by_recompute(forward, grad_out, query, key, value, out, lse)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def op_schemas() -> dict[str, Any]:
    """The schema of every aten op used here (for the pinning test)."""
    ops = (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._flash_attention_forward,
        aten._flash_attention_backward,
        aten._efficient_attention_forward,
        aten._efficient_attention_backward,
    )
    return {op.default._schema.name: str(op.default._schema) for op in ops}
