"""Context parallel's CUDA branch checked by value on CPU (issue 67, items 1 and 2): torch's CUDA attention kernels
replaced by emulators written from torch's sources (``tests/emulated_kernels.py``), the branch run end to end
through them against plain attention, and a sweep of every block plan over cp 2/4/8, chunk sizes and every
window, counting the rows whose keys FlashAttention-2 would read otherwise than the plan states."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cuboid import compat
from cuboid.compat import attention as kernels
from cuboid.context import attention as cp_module
from cuboid.context.attention import chunk_ids, cp_attention
from cuboid.context.blocks import plan_blocks


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _ours(rows: int, keys: int, shape: compat.BlockShape) -> torch.Tensor:
    if shape.visible is not None:
        return shape.visible
    if shape.causal:
        return compat.window_mask(rows, keys, None, 0)
    return torch.ones(rows, keys, dtype=torch.bool)


def _misread(cp: int, chunk: int, window: int, choose: bool) -> tuple[int, int]:
    """Over every rank's plan: (rows whose keys the kernel reads otherwise than the plan states, of those the rows
    it leaves with no key) for FlashAttention-2 as the branch calls it (``choose``: with ``block_kernel``'s choice;
    else every block on FlashAttention, as before the fix)."""
    differ = empty = 0
    for rank in range(cp):
        for blocks in plan_blocks(chunk_ids(rank, cp), chunk, 2 * cp * chunk, True, window):
            for start, end, shape in blocks:
                rows, keys = chunk, end - start
                used = kernels.block_kernel("cuda_flash", shape, rows, keys) if choose else "cuda_flash"
                ours = _ours(rows, keys, shape)
                read = kernels.flash_visible(rows, keys, shape.causal, shape.window) if used == "cuda_flash" else ours
                wrong = (read != ours).any(-1)
                differ += int(wrong.sum())
                empty += int((wrong & ~read.any(-1) & ours.any(-1)).sum())
    return differ, empty


def test_flashattention_reads_a_long_windows_lower_edge_block_otherwise_and_the_branch_no_longer_hands_it_one() -> None:
    """The reading of issue 67, item 2, confirmed by emulation: Mistral's 4096 window at 16k tokens on cp 4 (and
    at 32k on cp 8), Gemma 3's 1024 at 8k on cp 8: on rank 1 the lower-edge block of chunk 1 has 2048 rows (512)
    and one key; FlashAttention-2 normalises the window's right bound to that one key and leaves 2046 of its rows
    (510) with none, a log-sum-exp of +inf, NaN in the merge. With ``block_kernel``'s choice no row differs."""
    for cp, seq_len, window, chunk in ((4, 16384, 4096, 2048), (8, 32768, 4096, 2048), (8, 8192, 1024, 512)):
        blocks = plan_blocks(chunk_ids(1, cp), chunk, seq_len, True, window)[0]
        start, end, shape = blocks[0]
        read = kernels.flash_visible(chunk, end - start, shape.causal, shape.window)
        assert (end - start, int((~read.any(-1)).sum())) == (1, chunk - 2), (cp, seq_len, window, end - start)
        assert bool(_ours(chunk, end - start, shape).any(-1).all())  # every row sees that key in the plan
        assert kernels.block_kernel("cuda_flash", shape, chunk, end - start) == "cuda_efficient"


def test_the_host_decision_agrees_with_the_emulated_masks_on_every_small_block() -> None:
    """``flash_reads_as_ours`` decides from sizes alone (no tensor: it runs under fake tensors too); on every block
    of 1-11 rows and keys, causal or not, every pair of bounds, it answers as comparing the emulated masks does."""
    import itertools

    bounds = [None, 0, 1, 3, 7, 12]
    for rows, keys in itertools.product(range(1, 12), range(1, 12)):
        for causal, window in [(True, None), (False, None), *((False, w) for w in itertools.product(bounds, bounds))]:
            ours = compat.window_mask(rows, keys, None, 0) if causal else (
                compat.window_mask(rows, keys, *window) if window else torch.ones(rows, keys, dtype=torch.bool))  # fmt: skip
            want = all(torch.equal(kernels.flash_visible(rows, keys, causal, window, backward), ours)
                       for backward in (False, True))  # fmt: skip
            assert kernels.flash_reads_as_ours(rows, keys, causal, window) == want, (rows, keys, causal, window)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_no_block_of_any_plan_is_read_otherwise_than_it_states(cp: int) -> None:
    """Every window from 1 to the sequence, chunk sizes 4, 8 and 16: the rows FlashAttention-2 would read
    otherwise, every block on it (before), and with the branch's choice of kernel (after: 0)."""
    before = after = 0
    for chunk in (4, 8, 16):
        for window in range(1, 2 * cp * chunk):
            before += _misread(cp, chunk, window, choose=False)[0]
            after += _misread(cp, chunk, window, choose=True)[0]
    print(f"cp{cp}: rows read otherwise than the plan, every window and chunk: {before} before, {after} after")
    assert before > 0 and after == 0, (before, after)


def _reference(q, k, v, window, real, sink, scale):  # noqa: ANN001, ANN202  (plain attention, float64)
    q, k, v = (t.double() for t in (q, k, v))
    heads, tokens = q.shape[1], q.shape[2]
    k, v = k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * scale
    pos = torch.arange(tokens)
    seen = pos[None, :] <= pos[:, None]
    if window is not None:
        seen = seen & (pos[None, :] > pos[:, None] - window)
    seen = seen[None, None] & (real[:, None, None, :] if real is not None else True)
    s = s.masked_fill(~seen, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])], dim=2)
    return torch.softmax(s, -1) @ v


CASES = {
    "causal": {},
    "window_lower_edge": {"window": 20},  # chunk 16: its lower-edge block has 16 rows and 5 keys
    "window_short": {"window": 6},
    "window_long": {"window": 31},
    "gqa": {"kv_heads": 2, "window": 20},
    "padding": {"padded": True, "window": 20},  # the memory-efficient kernel, its bias
    "sink": {"sink": True, "window": 20},
    "mla": {"v_dim": 6},  # a value head dim unlike the query's (DeepSeek-V3: 192 / 128): no more torch.stack crash
    "mla_window": {"v_dim": 6, "window": 20},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("device", ["cuda_emulated", "cpu"])
def test_the_cuda_branch_through_the_emulated_kernels_equals_plain_attention(case: str, device: str, one_rank,
                                                                            monkeypatch) -> None:  # fmt: skip
    """The branch end to end on CPU (its plan, slices, kernel calls with their arguments, merges, dead rows,
    backward), torch's CUDA kernels emulated: output and q, k, v (and sink) gradients equal plain attention's
    within 1e-5 in fp32; and the same cases on the CPU kernels. One rank (two chunks of 16: every kind of block a
    plan makes)."""
    from emulated_kernels import aten_with_emulators

    if device == "cuda_emulated":
        monkeypatch.setattr(kernels, "aten", aten_with_emulators(torch.ops.aten))
        monkeypatch.setattr(cp_module, "attention_kernel",
                            lambda q, cp, padded, softcap, dropout_p=0.0: "cuda_efficient" if padded else "cuda_flash")  # fmt: skip
    spec = CASES[case]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 8, generator=g, requires_grad=True)
    kv = spec.get("kv_heads", 4)
    k = torch.randn(2, kv, 32, 8, generator=g, requires_grad=True)
    v = torch.randn(2, kv, 32, spec.get("v_dim", 8), generator=g, requires_grad=True)
    real = torch.ones(2, 32, dtype=torch.bool)
    if spec.get("padded"):
        real[0, 27:] = False  # right padding: every row keeps a real key
        real[1, 30:] = False
    sink = torch.randn(4, generator=g, requires_grad=True) if spec.get("sink") else None
    window = spec.get("window")
    got = cp_attention(q, k, v, one_rank, 32, scale=0.3, enable_gqa=kv != 4, key_padding=real if spec.get("padded") else None,
                       window=window, sink=sink)  # fmt: skip
    want = _reference(q, k, v, window, real if spec.get("padded") else None, sink, 0.3)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    leaves = [t for t in (q, k, v, sink) if t is not None]
    mine = torch.autograd.grad((got.double() * grad).sum(), leaves)
    theirs = torch.autograd.grad((want * grad).sum(), leaves)
    assert torch.isfinite(got).all() and (got.double() - want).abs().max() <= 1e-5, (got.double() - want).abs().max()
    for name, a, b in zip("qkvs", mine, theirs, strict=False):
        assert (a.double() - b).abs().max() <= 1e-5, (case, name, (a.double() - b).abs().max())


def test_before_the_choice_the_lower_edge_block_went_wrong_or_nan(one_rank, monkeypatch) -> None:
    """What the choice prevents, through the same emulated branch: every block on FlashAttention-2 as it was
    (``block_kernel`` left out). A window of 31 (chunk 1's lower-edge block: 16 rows, 2 keys) leaves 12 rows with
    no key, a log-sum-exp of +inf, NaN out of the merge; a window of 20 (16 rows, 13 keys) takes keys from the first
    rows without emptying them: finite and wrong."""
    from emulated_kernels import aten_with_emulators

    monkeypatch.setattr(kernels, "aten", aten_with_emulators(torch.ops.aten))
    monkeypatch.setattr(cp_module, "attention_kernel", lambda *args, **kwargs: "cuda_flash")
    monkeypatch.setattr(kernels, "block_kernel", lambda kernel, shape, rows, keys: kernel)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    assert int(torch.isnan(cp_attention(q, k, v, one_rank, 32, window=31)).any(-1).sum()) == 2 * 12
    off = cp_attention(q, k, v, one_rank, 32, window=20).double() - _reference(q, k, v, 20, None, None, 8**-0.5)
    assert torch.isfinite(off).all() and off.abs().max() > 1e-2, off.abs().max()
