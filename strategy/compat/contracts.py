"""CUDA's contracts, checked on CPU: a dispatch mode that holds every aten op Cuboid calls directly (attention with
its log-sum-exp, grouped GEMMs) to the preconditions its CUDA kernel has and its CPU twin lacks.

The CPU kernels honour strides, take any head dim and check little; the CUDA kernels read some arguments through
raw pointers and check only part of what they assume. A CPU run can then be right where a GPU run is silently wrong
(FlashAttention's backward reads a strided log-sum-exp as if contiguous: every row but the first reads another
row's). Under :class:`CudaContracts`, each such op is checked before it runs; a breach raises
:class:`CudaContractError` naming the op, the argument and the rule. On in the context- and expert-parallel tests,
and over fake CUDA tensors (``FakeTensorMode``), where the CUDA ops themselves are called.

The rules, read from torch 2.11 and 2.13 (the headers and binaries of their CUDA wheels; ``flash_api.cpp``,
``attention.cu``, ``attention_backward.cu``, ``kernel_forward.h``, ``kernel_backward.h``, ``GroupedMMUtils.h``,
``GroupMMCommon.cuh``):

- FlashAttention-2 (``_flash_attention_forward``/``_backward`` on ``(batch, tokens, heads, dim)``; the
  ``_scaled_dot_product_flash_attention`` pair on ``(batch, heads, tokens, dim)``): fp16/bf16; the last dim
  contiguous, every other stride a multiple of 8 elements and the data 16-byte aligned (its 128-bit loads; unchecked
  there); a head dim of at most 256 in multiples of 8, the same for values; query heads a multiple of key heads, as
  many value heads as key heads; no ALiBi (compiled out); the backward's log-sum-exp contiguous float32 ``(batch,
  query heads, query tokens)`` (read by its raw pointer, no check).
- The memory-efficient kernel (``_efficient_attention_forward``/``_backward``, ``(batch, tokens, heads, dim)``):
  fp16/bf16/fp32; as many key and value heads as query heads; the last dim contiguous, token and head strides
  multiples of 8 elements (4 in fp32), 16-byte aligned data; a bias of exactly ``(batch, heads, queries, keys)``
  sizes in the query's dtype, its last dim contiguous, its other strides multiples of 8 (4 in fp32) or 0; the
  backward's log-sum-exp float32 ``(batch, heads, queries padded to 32)`` with its last dim contiguous, and an ``out``
  whose token stride is heads x dim (the kernel assumes it, unchecked); a ``window_size`` only with a causal mask type.
- The CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``/``_backward``) where Cuboid calls it
  (:mod:`cuboid.compat.attention`), in place of one of the two above on a GPU: what both of those share about the layout (the last dim contiguous, the head dims,
  the heads' ratio) and FlashAttention's rule for the backward's log-sum-exp (contiguous, ``(batch, query heads,
  query tokens)``; float32, or float64 beside float64 inputs, which no GPU kernel takes). Where torch's own
  ``scaled_dot_product_attention`` calls it (a model's attention on CPU), its CUDA twin is another op with its own
  layout (the CPU kernel returns its log-sum-exp strided; CUDA's flash forward returns it contiguous): not checked.
- Grouped GEMMs (``_grouped_mm``): 16-byte aligned operands (the CPU path skips that check); int32 offsets that never
  decrease, none past the dimension they split, at most 1024 groups (device asserts on a GPU, none on CPU).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class CudaContractError(AssertionError):
    """An aten op called with arguments its CUDA kernel does not take (or reads wrongly): op, argument, rule."""


def _fail(op: str, what: str) -> None:
    raise CudaContractError(f"{op}: {what} (a CUDA kernel's precondition; see cuboid.compat.contracts)")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _aligned_data(t: torch.Tensor) -> bool:
    """16-byte aligned data: the storage's own start (an allocation) plus the view's offset."""
    start = 0 if _is_fake(t) else t.untyped_storage().data_ptr()
    return (start + t.storage_offset() * t.element_size()) % 16 == 0


def _strides_multiple(t: torch.Tensor, of: int, dims: tuple[int, ...]) -> bool:
    return all(t.stride(d) % of == 0 or t.shape[d] == 1 for d in dims)


def _layout(op: str, name: str, t: torch.Tensor, align: int, token_dim: int, head_dim: int) -> None:
    """Last dim contiguous, token and head strides multiples of ``align`` elements, 16-byte aligned data."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        _fail(op, f"{name} must have a contiguous last dim (stride {t.stride(-1)}, shape {tuple(t.shape)})")
    if not _strides_multiple(t, align, (0, token_dim, head_dim)):
        _fail(op, f"{name}'s strides {t.stride()} must be multiples of {align} elements (its vector loads)")
    if not _aligned_data(t):
        _fail(op, f"{name} must start 16-byte aligned (storage offset {t.storage_offset()} x {t.element_size()} B)")


def _heads(op: str, q_heads: int, k_heads: int, v_heads: int, equal: bool) -> None:
    if k_heads != v_heads:
        _fail(op, f"keys and values must have as many heads ({k_heads} vs {v_heads})")
    if equal and q_heads != k_heads:
        _fail(
            op, f"query and key heads must be equal ({q_heads} vs {k_heads}): this kernel takes no grouped-query heads"
        )
    if q_heads % k_heads:
        _fail(op, f"query heads ({q_heads}) must be a multiple of key heads ({k_heads})")


def _lse(op: str, lse: torch.Tensor, shape: tuple[int, ...], inputs: torch.dtype, padded_to: int = 1) -> None:
    rows = shape[-1]
    want = (*shape[:-1], -(-rows // padded_to) * padded_to)
    if tuple(lse.shape) != want:
        _fail(op, f"the log-sum-exp must be {want} (batch, query heads, query rows), got {tuple(lse.shape)}")
    wide = torch.float64 if inputs == torch.float64 else torch.float32
    if lse.dtype != wide:
        _fail(op, f"the log-sum-exp must be {wide}, got {lse.dtype}")
    if padded_to == 1 and not lse.is_contiguous():
        _fail(op, f"the log-sum-exp must be contiguous (read by its raw pointer), got strides {lse.stride()}")
    if lse.stride(-1) != 1:
        _fail(op, f"the log-sum-exp's last dim must be contiguous, got strides {lse.stride()}")


def _flash(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bshd: bool) -> None:
    """FlashAttention-2's inputs (``bshd``: ``(batch, tokens, heads, dim)``, else ``(batch, heads, tokens, dim)``)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(op, f"FlashAttention takes fp16 or bf16 query, key and value alike, got {q.dtype}/{k.dtype}/{v.dtype}")
    token, head = (1, 2) if bshd else (2, 1)
    for name, t in (("query", q), ("key", k), ("value", v)):
        _layout(op, name, t, 8, token, head)
    d, dv = q.shape[-1], v.shape[-1]
    if d % 8 or d > 256 or dv != d or k.shape[-1] != d:
        _fail(op, f"head dims must be equal, at most 256, in multiples of 8 (query {d}, key {k.shape[-1]}, value {dv})")
    _heads(op, q.shape[head], k.shape[head], v.shape[head], equal=False)


def _check_flash_forward(op: str, args: tuple, kwargs: dict) -> None:
    _flash(op, args[0], args[1], args[2], bshd=True)
    if kwargs.get("alibi_slopes") is not None:
        _fail(op, "torch's FlashAttention is built without ALiBi")
    if kwargs.get("seqused_k") is not None and args[3] is None:
        _fail(op, "seqused_k is read by the variable-length kernel only (cum_seq_q/cum_seq_k)")


def _check_flash_backward(op: str, args: tuple, kwargs: dict) -> None:
    grad_out, q, k, v, out, lse = args[:6]
    _flash(op, q, k, v, bshd=True)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if tuple(t.shape) != tuple(q.shape) or (t.stride(-1) != 1 and t.shape[-1] != 1):
            _fail(op, f"{name} must be {tuple(q.shape)} with a contiguous last dim, got {tuple(t.shape)} {t.stride()}")
    _lse(op, lse, (q.shape[0], q.shape[2], q.shape[1]), q.dtype)


def _check_sdpa_flash_backward(op: str, args: tuple, kwargs: dict) -> None:
    grad_out, q, k, v, out, lse = args[:6]
    _flash(op, q, k, v, bshd=False)
    _lse(op, lse, tuple(q.shape[:3]), q.dtype)


def _efficient(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(op, f"the memory-efficient kernel takes fp16, bf16 or fp32 alike, got {q.dtype}/{k.dtype}/{v.dtype}")
    align = 4 if q.dtype == torch.float32 else 8
    for name, t in (("query", q), ("key", k), ("value", v)):
        _layout(op, name, t, align, 1, 2)
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align:
        _fail(op, f"head dims: query and key equal, in multiples of {align} (query {q.shape[-1]}, key {k.shape[-1]})")
    _heads(op, q.shape[2], k.shape[2], v.shape[2], equal=True)
    return align


def _bias(op: str, bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, align: int) -> None:
    if bias is None:
        return
    want = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if tuple(bias.shape) != want:
        _fail(op, f"the bias must be exactly {want} (batch, heads, queries, keys; broadcast by expand), got "
                  f"{tuple(bias.shape)}")  # fmt: skip
    if bias.dtype != q.dtype:
        _fail(op, f"the bias must be in the query's dtype {q.dtype}, got {bias.dtype}")
    if bias.stride(3) != 1 and bias.shape[3] != 1:
        _fail(op, f"the bias's last dim must be contiguous, got strides {bias.stride()}")
    if not all(s % align == 0 for s in bias.stride()[:3]):
        _fail(op, f"the bias's strides {bias.stride()} must be 0 or multiples of {align} elements")
    if not _aligned_data(bias):
        _fail(op, "the bias must start 16-byte aligned")


def _check_efficient_forward(op: str, args: tuple, kwargs: dict) -> None:
    q, k, v, bias = args[:4]
    align = _efficient(op, q, k, v)
    _bias(op, bias, q, k, align)
    custom = args[9] if len(args) > 9 else kwargs.get("custom_mask_type", 0)
    if (kwargs.get("window_size") or 0) > 0 and custom not in (1, 2):
        _fail(op, "a window_size needs a causal custom_mask_type (1 or 2)")


def _check_efficient_backward(op: str, args: tuple, kwargs: dict) -> None:
    grad_out, q, k, v, bias, out = args[:6]
    lse = args[10]
    align = _efficient(op, q, k, v)
    _bias(op, bias, q, k, align)
    _lse(op, lse, (q.shape[0], q.shape[2], q.shape[1]), q.dtype, padded_to=32)
    heads, dim = out.shape[2], out.shape[3]
    if out.stride(1) != heads * dim or out.stride(3) != 1:
        _fail(op, f"out must be a (batch, tokens, heads, dim) buffer of its own: token stride {heads * dim} and "
                  f"a contiguous last dim, got strides {out.stride()} (the kernel assumes it, unchecked)")  # fmt: skip


def _called_by_cuboid() -> bool:
    """Whether the op being dispatched was called from :mod:`cuboid.compat.attention` (not from inside torch, as
    ``scaled_dot_product_attention`` and autograd's engine call the same op)."""
    frame = sys._getframe(3)
    for _ in range(8):
        if frame is None:
            return False
        name = frame.f_globals.get("__name__", "")
        if name == "cuboid.compat.attention":
            return True
        if not (name.startswith("torch") or name == __name__):
            return False
        frame = frame.f_back
    return False


def _check_cpu_flash(op: str, args: tuple, kwargs: dict) -> bool:
    """The CPU kernel where a GPU runs FlashAttention-2 or the memory-efficient kernel: their shared layout rules
    (False: not Cuboid's call, not checked)."""
    if not _called_by_cuboid():
        return False
    q, k, v = args[:3]
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            _fail(op, f"{name} must have a contiguous last dim (stride {t.stride(-1)}), as every CUDA kernel needs")
    if q.shape[-1] % 8 or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        _fail(op, f"head dims must be equal and in multiples of 8 (query {q.shape[-1]}, value {v.shape[-1]})")
    _heads(op, q.shape[1], k.shape[1], v.shape[1], equal=False)
    return True


def _check_cpu_flash_backward(op: str, args: tuple, kwargs: dict) -> bool:
    if not _called_by_cuboid():
        return False
    grad_out, q, k, v, out, lse = args[:6]
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            _fail(op, f"{name} must have a contiguous last dim (stride {t.stride(-1)}), as every CUDA kernel needs")
    _lse(op, lse, tuple(q.shape[:3]), q.dtype)
    return True


def _check_grouped_mm(op: str, args: tuple, kwargs: dict) -> None:
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    for name, t in (("the first operand", a), ("the second operand", b)):
        if not _aligned_data(t):
            _fail(op, f"{name} must start 16-byte aligned (the CPU path does not check it)")
    if offs is None:
        return
    if offs.dtype != torch.int32 or offs.dim() != 1:
        _fail(op, f"offsets must be a 1-D int32 tensor, got {offs.dtype} {tuple(offs.shape)}")
    if offs.numel() > 1024:
        _fail(op, f"at most 1024 groups, got {offs.numel()}")
    if _is_fake(offs):
        return
    dim = a.shape[0] if a.dim() == 2 and b.dim() == 3 else b.shape[-1] if a.dim() == 3 else a.shape[-1]
    values = offs.tolist()  # a check's own host read (this mode is for tests)
    if any(later < earlier for earlier, later in zip(values, values[1:], strict=False)) or (values and values[0] < 0):
        _fail(op, f"offsets must never decrease (a device assert on a GPU), got {values}")
    if values and values[-1] > dim:
        _fail(op, f"offsets must not pass the split dimension's {dim} (a device assert on a GPU), got {values[-1]}")


CHECKS: dict[Any, Callable[[str, tuple, dict], bool | None]] = {
    aten._flash_attention_forward.default: _check_flash_forward,
    aten._flash_attention_backward.default: _check_flash_backward,
    aten._scaled_dot_product_flash_attention.default: lambda op, a, k: _flash(op, a[0], a[1], a[2], bshd=False),
    aten._scaled_dot_product_flash_attention_backward.default: _check_sdpa_flash_backward,
    aten._efficient_attention_forward.default: _check_efficient_forward,
    aten._efficient_attention_backward.default: _check_efficient_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _check_cpu_flash,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _check_cpu_flash_backward,
    aten._grouped_mm.default: _check_grouped_mm,
}


class CudaContracts(TorchDispatchMode):
    """While entered, every op of :data:`CHECKS` is checked against its CUDA kernel's preconditions before it runs
    (:class:`CudaContractError` on a breach); ``checked`` counts the calls checked, by op (a check that does not
    apply to a call, torch's own call of the CPU flash kernel, returns False and is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        check = CHECKS.get(func)
        if check is not None:
            name = str(func.overloadpacket.__name__)
            if check(f"aten.{name}", args, kwargs) is not False:
                self.checked[name] = self.checked.get(name, 0) + 1
        return func(*args, **kwargs)
