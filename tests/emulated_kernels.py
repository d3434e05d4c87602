"""What torch's CUDA attention kernels compute with the arguments Cuboid hands them, on CPU: each emulator takes
the aten op's own arguments (``(batch, tokens, heads, dim)`` tensors, as ``cuboid.compat.attention`` passes them)
and returns what the op returns, read from torch's sources (``aten/src/ATen/native/transformers/cuda/``):

- ``_flash_attention_forward`` / ``_flash_attention_backward`` (FlashAttention-2): the window normalised as
  ``flash_attn/flash_api.cpp`` does (``mha_fwd``, ``set_params_fprop``) and masked as ``flash_attn/mask.h`` does
  (:func:`cuboid.compat.attention.flash_visible`); grouped-query heads as they come (``num_heads % num_heads_k``);
  the log-sum-exp ``(batch, heads, rows)`` float32, +inf for a row that sees no key (``flash_attn/softmax.h``
  ``normalize_softmax_lse``: ``sum == 0 -> INFINITY``, ``inv_sum = 1``), whose output is zeros; the backward's
  probabilities ``exp(scale * s - lse)`` under ``mha_bwd``'s normalisation of the window.
- ``_efficient_attention_forward`` / ``_efficient_attention_backward`` (the memory-efficient kernel): the additive
  ``attn_bias`` as given, ``custom_mask_type`` 1 causal from the top left (``mem_eff_attention``'s
  ``CausalFromTopLeft``), equal head counts, the log-sum-exp padded to a multiple of 32 rows with +inf
  (``kernel_forward.h``: ``kAlignLSE = 32``); a row every key of which is masked: output 0
  (``epilogue_rescale_output.h``: ``s_prime == 0 ? 1``), log-sum-exp -inf (``mi / kLog2e + log(0)``).

Dropout is not emulated (Cuboid hands every kernel ``dropout_p = 0``; an emulator refuses another).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from cuboid.compat.attention import flash_visible

INF = float("inf")


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, tokens, kv heads, dim) -> one per query head, grouped as FlashAttention reads them (head h reads
    kv head h // (heads // kv heads))."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale


def flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                  window_size_left=None, window_size_right=None, **_: Any):  # fmt: skip
    assert dropout_p == 0.0 and cu_q is None and cu_k is None
    rows, keys, heads = q.shape[1], k.shape[1], q.shape[2]
    assert heads % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query"
    seen = flash_visible(rows, keys, is_causal, (window_size_left, window_size_right))
    s = _scores(q, _heads(k, heads), scale).masked_fill(~seen, -INF)
    lse = torch.logsumexp(s, dim=-1)
    lse = lse.masked_fill(~seen.any(-1), INF)  # softmax.h: a row whose sum is 0 gets +inf (not split)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, _heads(v, heads).float()).to(q.dtype)
    return out, lse, torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64), torch.empty(0)


def flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *,
                   scale=None, window_size_left=None, window_size_right=None, **_: Any):  # fmt: skip
    assert dropout_p == 0.0 and lse.is_contiguous() and lse.dtype == torch.float32
    rows, keys, heads, kv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    seen = flash_visible(rows, keys, is_causal, (window_size_left, window_size_right), backward=True)  # mha_bwd's
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kk, vv = _heads(k, heads).float(), _heads(v, heads).float()
    s = _scores(q, kk, scale).masked_fill(~seen, -INF)
    p = torch.exp(s - lse[..., None])
    do, o = dout.float(), out.float()
    delta = (do * o).sum(-1).transpose(1, 2)  # (batch, heads, rows): flash_bwd_preprocess_kernel.h's dot(dO, O)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale
    group = heads // kv  # the query heads of one kv head: their key/value gradients summed
    dk = dk.view(*dk.shape[:2], kv, group, dk.shape[-1]).sum(3)
    dv = dv.view(*dv.shape[:2], kv, group, dv.shape[-1]).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _efficient_scores(q, k, bias, custom_mask_type, scale) -> torch.Tensor:
    assert q.shape[2] == k.shape[2], "the memory-efficient kernel takes equal head counts"
    s = _scores(q, k, scale)
    if bias is not None:
        s = s + bias.float()
    if custom_mask_type == 1:  # CausalFromTopLeft: row i sees keys 0 .. i
        rows, keys = s.shape[-2:]
        s = s.masked_fill(torch.ones(rows, keys, dtype=torch.bool).triu(1), -INF)
    else:
        assert custom_mask_type == 0
    return s


def efficient_forward(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, custom_mask_type, compute_lse, *,
                      scale=None, **_: Any):  # fmt: skip
    assert dropout_p == 0.0 and compute_lse
    s = _efficient_scores(q, k, bias, custom_mask_type, scale)
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row every key of which is masked
    p = torch.exp(s - lse.masked_fill(lse == -INF, 0.0)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float()).to(q.dtype)
    rows = q.shape[1]
    padded = lse.new_full((*lse.shape[:2], -(-rows // 32) * 32), INF)
    padded[..., :rows] = lse
    return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), rows, k.shape[1]


def efficient_backward(dout, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, dropout_p, seed, offset,
                       custom_mask_type, bias_requires_grad, *, scale=None, **_: Any):  # fmt: skip
    assert dropout_p == 0.0 and not bias_requires_grad
    rows = q.shape[1]
    assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= rows
    scale_ = q.shape[-1] ** -0.5 if scale is None else scale
    s = _efficient_scores(q, k, bias, custom_mask_type, scale)
    p = torch.exp(s - lse[..., :rows, None])
    do, o = dout.float(), out.float()
    delta = (do * o).sum(-1).transpose(1, 2)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, v.float()) - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.float()) * scale_
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale_
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def aten_with_emulators(aten: Any) -> Any:
    """``torch.ops.aten`` with the CUDA attention ops replaced by their emulators (every other op as it is)."""
    ops = {
        "_flash_attention_forward": flash_forward,
        "_flash_attention_backward": flash_backward,
        "_efficient_attention_forward": efficient_forward,
        "_efficient_attention_backward": efficient_backward,
    }

    class Emulated(types.SimpleNamespace):
        def __getattr__(self, name: str) -> Any:
            return getattr(aten, name)

    return Emulated(**ops)
