"""The CUDA branch of context and expert parallel, run here on fake CUDA tensors: every case a GPU meets takes the
block path with a fused kernel for every block, each kernel's CUDA preconditions hold (``CudaContracts``), and no
tensor holds both a query length and the whole sequence's. The code above the kernel call is the same as on CPU: the
same blocks, in the same order, with the same shapes, windows and padding, whichever kernel runs them.

Fake CUDA tensors need a CUDA build of torch (a CPU build cannot even index one: its CUDA device guard is missing).
PyPI's torch 2.11 is one and runs on CPU: CI's floor job runs this module there; under the suite's CPU build of
torch it is skipped. Two limits of fake tensors, each covered elsewhere:

- autograd's engine needs a CUDA context for CUDA tensors, so the backward is called as the autograd function's own
  ``backward`` (``grad_fn.apply``), which is what the engine would call;
- FlexAttention (soft-capped scores on CUDA) traces itself with Dynamo, which fake tensors cannot enter: its call is
  recorded here with its arguments, its values and its backward by recompute are checked on CPU
  (``tests/test_compat.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cuboid import compat
from cuboid.compat import attention as kernels
from cuboid.context.attention import cp_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda._is_compiled(),
    reason="fake CUDA tensors need a CUDA build of torch: CI's floor job runs this module on PyPI's torch 2.11",
)

SEQ, CP, HEAD_DIM = 96, 2, 64  # chunks of 24 tokens
# name -> (dtype, heads, kv heads, causal, padding, window, sink, soft cap)
CASES: dict[str, tuple] = {
    "causal-bf16": (torch.bfloat16, 4, 4, True, None, None, False, None),
    "gqa-fp16": (torch.float16, 4, 2, True, None, None, False, None),
    "fp32": (torch.float32, 4, 2, True, None, None, False, None),
    "padding-right": (torch.bfloat16, 4, 2, True, "right", None, False, None),
    "padding-left": (torch.bfloat16, 4, 2, True, "left", None, False, None),
    "window-in-a-chunk": (torch.bfloat16, 4, 2, True, None, 7, False, None),
    "window-over-chunks": (torch.bfloat16, 4, 2, True, None, 50, False, None),
    "window-padded": (torch.float16, 4, 2, True, "left", 50, False, None),
    "sink": (torch.bfloat16, 4, 2, True, None, 20, True, None),
    "softcap": (torch.bfloat16, 4, 2, True, "right", 20, False, 50.0),
    "bidirectional-padded": (torch.bfloat16, 2, 1, False, "left", None, False, None),
}
FUSED = {"cuda_flash", "cuda_efficient", "cuda_flex"}


@pytest.fixture(scope="module")
def group() -> Iterator[Any]:
    """Two ranks of torch's fake process group (this process is rank 0; collectives do nothing)."""
    compat.init_fake_process_group(CP)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor an op makes that holds both a query length and the whole sequence's (a view of fewer elements,
    an ``expand``, is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        rows = {SEQ // CP, SEQ // (2 * CP)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            owns = isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= t.numel() * t.element_size()
            if owns and SEQ in t.shape and rows & set(t.shape):
                self.found.append((str(func), tuple(t.shape)))
        return out


@contextmanager
def _recorded(calls: list, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each block call: its kernel, and what above the kernel decided (rows, keys, diagonal, window, padding)."""
    run = compat.lse_attention

    def recorded(kernel, q, k, v, shape, real, scale, softcap=None):  # noqa: ANN001, ANN202
        calls.append((kernel, q.shape[2], k.shape[2], shape.causal, shape.window, real is not None))
        return run(kernel, q, k, v, shape, real, scale, softcap)

    monkeypatch.setattr(compat, "lse_attention", recorded)
    yield
    monkeypatch.setattr(compat, "lse_attention", run)


def _flex_stand_in(monkeypatch: pytest.MonkeyPatch, seen: list) -> None:
    """FlexAttention's call and its backward by recompute, recorded with the shapes they would return."""

    def flex(query, key, value, shape, real, scale, softcap, compiled=True):  # noqa: ANN001, ANN202
        seen.append(("flex", tuple(query.shape), tuple(key.shape), softcap))
        return torch.empty_like(query), query.new_empty(query.shape[:3], dtype=torch.float32)

    def recompute(forward, grad_out, query, key, value, out, lse):  # noqa: ANN001, ANN202
        seen.append(("flex backward", tuple(query.shape), tuple(key.shape)))
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    monkeypatch.setattr(kernels, "_flex_call", flex)
    monkeypatch.setattr(kernels, "_backward_by_recompute", recompute)


def _inputs(device: str, case: tuple) -> tuple:
    dtype, heads, kv_heads, causal, side, window, with_sink, softcap = case
    local = SEQ // CP

    def make(h: int) -> torch.Tensor:
        t = torch.randn(2, h, local, HEAD_DIM, device=device)
        return t.to(dtype if device == "cuda" else torch.float32).requires_grad_()

    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    real = None
    if side is not None:
        real = torch.ones(2, SEQ, dtype=torch.bool, device=device)
        if device == "cpu":  # values only where they are real tensors
            real[0, SEQ - 30 :] = False
            real = real if side == "right" else real.flip(1)
    sink = torch.randn(heads, device=device) if with_sink else None
    return (
        q,
        k,
        v,
        real,
        dict(is_causal=causal, window=window, sink=sink, softcap=softcap, enable_gqa=heads != kv_heads),
    )


def _run(group: Any, device: str, case: tuple) -> tuple[torch.Tensor, tuple]:
    q, k, v, real, kwargs = _inputs(device, case)
    out = cp_attention(q, k, v, group, SEQ, key_padding=real, **kwargs)
    with torch.no_grad():  # the autograd function's backward, as the engine calls it
        grads = out.grad_fn.apply(torch.ones_like(out))
    return out, grads


@pytest.mark.parametrize("name", list(CASES))
def test_every_block_of_every_case_takes_a_fused_kernel_within_its_contract_and_no_lq_x_s_tensor(
    name: str, group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls: list = []
    flex: list = []
    _flex_stand_in(monkeypatch, flex)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with _recorded(calls, monkeypatch), compat.CudaContracts() as contracts, _Shapes() as shapes:
            out, grads = _run(group, "cuda", CASES[name])
    assert out.device.type == "cuda" and out.shape == (2, CASES[name][1], SEQ // CP, HEAD_DIM)
    assert [tuple(g.shape) for g in grads[:3]] == [(2, CASES[name][1], SEQ // CP, HEAD_DIM)] + 2 * [
        (2, CASES[name][2], SEQ // CP, HEAD_DIM)
    ]
    assert calls and {kernel for kernel, *_ in calls} <= FUSED, calls
    checked = sum(contracts.checked.values())
    if CASES[name][7] is None:  # each block's forward and backward went through a checked CUDA op
        assert checked == 2 * len(calls), (contracts.checked, calls)
    else:  # FlexAttention, forward and backward, for every block
        assert [what for what, *_ in flex] == ["flex"] * len(calls) + ["flex backward"] * len(calls), flex
    assert shapes.found == [], shapes.found[:5]


@pytest.mark.parametrize("name", list(CASES))
def test_the_code_above_the_kernel_is_the_same_on_cpu_and_cuda(
    name: str, group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same blocks, in the same order (rows, keys, diagonal, window, padding), on real CPU tensors with the CPU
    kernels and on fake CUDA tensors with the CUDA ones: padding, windows, sinks and soft-capping take the block
    path with either kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    on_cpu: list = []
    with _recorded(on_cpu, monkeypatch):
        _run(group, "cpu", CASES[name])
    on_cuda: list = []
    _flex_stand_in(monkeypatch, [])
    with FakeTensorMode(allow_non_fake_inputs=True), _recorded(on_cuda, monkeypatch):
        _run(group, "cuda", CASES[name])
    assert {kernel for kernel, *_ in on_cpu} <= {"cpu_flash", "cpu_softcap"}
    assert [call[1:] for call in on_cpu] == [call[1:] for call in on_cuda]


def test_the_kernel_a_gpu_takes_for_each_case_is_the_one_torchs_attention_would() -> None:
    """Chosen as ``scaled_dot_product_attention`` chooses on CUDA (torch 2.11's ``sdp_utils.cpp``): FlashAttention
    with no mask in fp16/bf16 up to a head dim of 256, else the memory-efficient kernel; none for what neither takes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():

        def q(dtype: torch.dtype = torch.bfloat16, dim: int = 64) -> torch.Tensor:
            return torch.empty(1, 2, 8, dim, device="cuda", dtype=dtype)

        assert compat.lse_kernel(q()) == "cuda_flash" == compat.lse_kernel(q(torch.float16, 256))
        assert compat.lse_kernel(q(), padded=True) == "cuda_efficient"
        assert compat.lse_kernel(q(torch.float32)) == "cuda_efficient" == compat.lse_kernel(q(dim=512))
        assert compat.lse_kernel(q(), softcap=True) == "cuda_flex"
        for bad in (q(torch.float64), q(dim=60)):
            with pytest.raises(compat.KernelUnavailable):
                compat.lse_kernel(bad)


def test_experts_grouped_gemms_on_cuda_meet_their_contract() -> None:
    """Expert parallel's CUDA branch after the exchange: each local expert's rows in one grouped GEMM per projection
    (bf16, int32 offsets, 16-byte aligned operands), as ``_grouped_mm``'s CUDA kernel takes them. (The exchange's
    split sizes are a host read, which fake tensors have no values for: it runs in the CPU tests.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuboid.experts.hf import _local_experts

    class Packed(torch.nn.Module):  # transformers' packed experts, four of them
        has_gate, has_bias, is_transposed, has_post_expert_norm = True, False, False, False

        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = torch.nn.Parameter(torch.empty(4, 2 * 64, 32, device="cuda", dtype=torch.bfloat16))
            self.down_proj = torch.nn.Parameter(torch.empty(4, 32, 64, device="cuda", dtype=torch.bfloat16))

        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

    with FakeTensorMode(allow_non_fake_inputs=True):
        module = Packed()
        rows = torch.empty(40, 32, device="cuda", dtype=torch.bfloat16)
        counts = torch.empty(4, dtype=torch.long, device="cuda")
        with compat.CudaContracts() as contracts:
            out = _local_experts(module, rows, [10, 10, 10, 10], counts)
    assert out.shape == (40, 32) and contracts.checked == {"_grouped_mm": 2}, contracts.checked
