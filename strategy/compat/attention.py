"""Attention kernels that also return each row's log-sum-exp, which ``F.scaled_dot_product_attention`` keeps to
itself: what merging attention over blocks of keys needs (context parallel's causal blocks,
``cuboid.context.blocks``). torch's own ring attention (``torch.distributed.tensor.experimental``) calls the same
aten ops; no public API returns the log-sum-exp. Pinned in ``tests/test_compat.py`` (the schemas of every op used
here, and the CPU kernel's values against ``scaled_dot_product_attention``).

Two kernels:

- ``"cpu_flash"`` (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward): any float dtype,
  grouped-query heads as they come, ``is_causal`` and an additive mask broadcast from ``(batch, 1, 1, keys)``.
  A row whose keys are all masked comes back as zeros with a log-sum-exp of 0 (the caller overrides that).
- ``"cuda_flash"`` (``aten._scaled_dot_product_flash_attention`` and its backward, FlashAttention-2): bf16 and
  fp16 on CUDA, head dims up to 256 in multiples of 8, grouped-query heads as they come, ``is_causal``, no mask.

Both kernels take the log-sum-exp of the *whole* row back in their backward (with the merged output): each block's
gradients are then its share of the whole attention's, as in FlashAttention's own backward.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def lse_kernel(query: torch.Tensor, masked: bool, dropout_p: float = 0.0) -> str | None:
    """The kernel that runs attention blocks of ``query``'s device and dtype with their log-sum-exp (``masked``:
    an additive key mask is needed), or None where there is none (the caller falls back to one masked call)."""
    if dropout_p:
        return None
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "cpu_flash"
    head_dim = query.shape[-1]
    if (
        query.device.type == "cuda"
        and not masked
        and query.dtype in (torch.bfloat16, torch.float16)
        and head_dim <= 256
        and head_dim % 8 == 0
    ):
        return "cuda_flash"
    return None


def lse_attention(
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``(out, lse, saved)``: attention of ``query`` over ``key``/``value`` (``(batch, heads, tokens, head_dim)``),
    each row's log-sum-exp ``(batch, heads, q_tokens)`` (float32, or float64 for float64 inputs), and what :func:`lse_attention_backward` needs."""
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        return out, lse, ()
    if kernel == "cuda_flash":
        assert mask is None, "cuda_flash takes no mask"
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, is_causal, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def lse_attention_backward(
    kernel: str,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float | None,
    saved: tuple,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``query``, ``key`` and ``value`` for one block, given the whole row's ``out`` and ``lse``."""
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
        )
    if kernel == "cuda_flash":
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset,
            scale=scale,
        )  # fmt: skip
    raise ValueError(f"unknown attention kernel {kernel!r}")


def op_schemas() -> dict[str, Any]:
    """The schema of every aten op used here (for the pinning test)."""
    ops = (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_backward,
    )
    return {op.default._schema.name: str(op.default._schema) for op in ops}
