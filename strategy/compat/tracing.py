"""Running a training step on fake tensors, and counting what it holds: torch's tools for it are private.

* ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors with shapes, dtypes and devices but no storage,
  so one step of a model that would not fit anywhere runs in milliseconds per operator. torch has no public door
  to it (``torch.compile`` and ``torch.export`` use it inside). ``allow_non_fake_inputs=True`` lets a real tensor
  (a torchmetrics state, a constant) meet fake ones; the results stay fake.
* ``TorchDispatchMode`` (``torch.utils._python_dispatch``; public in all but its module's name: FlopCounterMode is one)
  for :class:`LiveBytes`, a running total of the bytes a step holds, cheap enough for a 1B model's fake step
  (``MemTracker`` walks every tracked storage at each operator: 15 s there).
* ``MemTracker`` (``torch.distributed._tools.mem_tracker``): a dispatch mode that follows every storage alive in
  it and sorts the bytes by what they are (parameters, gradients, activations, backward's temporaries, optimizer
  state), with the step's peak. It counts fake storages as real ones, so the same tool measures a step on fake
  tensors (the planner's input, :mod:`cuboid.planning.measured`) and a real step (what a test checks the
  planner's prediction against).

``tests/test_compat.py`` pins them: LiveBytes on a fake step counts what MemTracker counts on the real one, the
RNN workspace and the grouped GEMM's shape are restored, and RealData runs what touches data alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# MemTracker's categories, by the names its snapshots use (its _MemRefType values).
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


def fake_mode() -> FakeTensorMode:
    """A fake-tensor mode in which real tensors may take part (they are treated as fake)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


class LiveBytes(TorchDispatchMode):
    """Bytes of every storage alive that an operator made inside this mode, plus ``start`` (what existed before and
    counts: parameters), with the largest total seen. O(1) per operator: each new storage is added once and taken
    away by a weak reference's callback when it is freed (views and in-place results add nothing). Works on fake
    tensors as on real ones. ``follow_resize``: storages resized in place count at their new size, as FSDP2 frees
    and refills its unsharded parameters (``UntypedStorage.resize_``, wrapped while the mode is on, as torch's
    MemTracker does)."""

    def __init__(self, start: int = 0, existing: Iterable[torch.Tensor] = (), on_peak: Any = None,
                 follow_resize: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.on_peak = on_peak  # called whenever the peak rises
        self.live = self.peak = start
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        for t in existing:  # counted in ``start``: their views add nothing, their freeing takes them away
            storage = t.untyped_storage()
            key = id(storage)  # (torch keeps a storage's Python object while the storage lives: ids are stable)
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
            self._sizes[key] = storage.nbytes()
        self._follow_resize = follow_resize
        self._resize: Any = None

    def _free(self, key: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= self._sizes.pop(key, 0)

    def _grow(self, delta: int) -> None:
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live
            if self.on_peak is not None:
                self.on_peak()

    def _register(self, storage: Any, nbytes: int) -> None:
        key = id(storage)
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        self._sizes[key] = nbytes
        self._grow(nbytes)

    def add(self, t: torch.Tensor, nbytes: int | None = None) -> None:
        storage = t.untyped_storage()
        if id(storage) not in self._refs:
            self._register(storage, storage.nbytes() if nbytes is None else nbytes)

    def __enter__(self) -> LiveBytes:
        if self._follow_resize:
            original = self._resize = torch.UntypedStorage.resize_

            def resize_(storage: Any, size: int) -> Any:
                before = storage.nbytes()
                out = original(storage, size)
                key = id(storage)
                if key in self._refs:
                    self._sizes[key] = storage.nbytes()
                    self._grow(storage.nbytes() - before)
                elif storage.nbytes() > before:  # made before the mode, sized now (FSDP2's unsharded parameters)
                    self._register(storage, storage.nbytes())
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
            self._resize = None
        super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default and isinstance(args[0], FakeTensor):
            self.add(out[3], _mkldnn_rnn_workspace(args))  # the real kernel's workspace, not the meta's empty one
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


def _mkldnn_rnn_workspace(args: tuple) -> int:
    """Bytes of the workspace oneDNN's RNN layer keeps for backward (gates and states of every time step): torch's
    meta kernel returns it empty (``torch/_meta_registrations.py``, ``mkldnn_rnn_layer``: ``workspace =
    torch.empty(0, ...)``), while the CPU kernel's grows as ``batch x time x hidden`` (about 61 bytes each for an
    LSTM). Found by running the real kernel on one and two samples of zeros and extending the line to the batch
    (the workspace is a fixed part plus a part linear in the batch; tests/test_compat.py checks the result)."""
    from torch.utils._python_dispatch import _disable_current_modes

    inp, *rest = args
    batch = int(rest[4].shape[0])  # hx: (batch, hidden); the input reaches the layer as (time, batch, features)
    dim = 1 if inp.shape[1] == batch else 0

    def real(n: int) -> int:
        with _disable_current_modes():
            part = torch.zeros([n if i == dim else k for i, k in enumerate(inp.shape)], dtype=inp.dtype)
            weights = [torch.zeros(w.shape, dtype=w.dtype) for w in rest[:4]]
            states = [torch.zeros((n, *h.shape[1:]), dtype=h.dtype) for h in rest[4:6]]
            ws = torch.ops.aten.mkldnn_rnn_layer.default(part, *weights, *states, *rest[6:])[3]
        return int(ws.numel() * ws.element_size())

    one, two = real(1), real(2)
    return one + (two - one) * (batch - 1)  # linear in the batch past oneDNN's fixed part (tests/test_compat.py)


class RealData(TorchDispatchMode):
    """Entered above a fake mode: an operator whose tensors are all real (the batch's token ids, a mask made from
    them) runs for real, so a step may read its data (``.item()``, ``nonzero``, a count of image tokens) while
    every weight and activation stays fake. Indexing a fake tensor with a real boolean mask goes through the mask's
    real positions (an output size fake tensors cannot know otherwise), and a grouped GEMM in fp32 (which the CPU
    kernel runs and the meta kernel refuses) is shaped here."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if flat and not any(isinstance(t, FakeTensor) for t in flat):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return _grouped_mm_output(*args, **kwargs)  # the CPU kernel's any float, which the meta refuses
        if func is torch.ops.aten.index.Tensor and any(_real_mask(i) for i in args[1]):
            indices: list[Any] = []
            for i in args[1]:
                if _real_mask(i):
                    with _disable_current_modes():
                        indices.extend(i.nonzero(as_tuple=True))
                else:
                    indices.append(i)
            return func(args[0], indices)
        return func(*args, **kwargs)


def _grouped_mm_output(a: torch.Tensor, b: torch.Tensor, offs: Any = None, bias: Any = None,
                       out_dtype: Any = None) -> torch.Tensor:  # fmt: skip
    """``F.grouped_mm``'s result, shaped as torch's meta kernel shapes it (``torch/_meta_registrations.py``,
    ``_create_grouped_mm_output_tensor``), for the float types the CPU kernel takes and the meta kernel refuses
    (it checks CUDA's bf16-only rule: "Expected inputs of BF16 type")."""
    if a.dim() == 2:
        size = [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
    else:
        size = [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]
    return torch.empty(size, dtype=out_dtype or a.dtype, device=a.device)


def _real_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.dtype == torch.bool


class StepMemory:
    """Bytes by category at the step's peak, and now (``current``), on every device the step touched, summed."""

    def __init__(self, tracker: MemTracker) -> None:
        self._tracker = tracker

    def _sum(self, which: str) -> dict[str, int]:
        out = dict.fromkeys((*CATEGORIES, "Total"), 0)
        for per_device in self._tracker.get_tracker_snapshot(which).values():
            for key, nbytes in per_device.items():
                name = getattr(key, "value", key)
                out[str(name)] = out.get(str(name), 0) + int(nbytes)
        return out

    def peak(self) -> dict[str, int]:
        return self._sum("peak")

    def current(self) -> dict[str, int]:
        return self._sum("current")


@contextmanager
def track_memory(
    module: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[StepMemory]:
    """Follow every tensor made inside, and ``module``'s parameters, gradients and buffers and ``optimizer``'s
    state made before (torch's ``MemTracker``). Its peak is the largest total seen inside."""
    tracker = MemTracker()
    external: list[Any] = [x for x in (module, optimizer) if x is not None]
    if external:
        tracker.track_external(*external)
    with tracker:
        yield StepMemory(tracker)
