"""torch's training-step internals Cuboid reads: which kind of forward is running (a step's own, a recompute inside
backward, a pipeline's metadata inference), and the function torch's Muon orthogonalizes with.

Part of :mod:`cuboid.compat` (which re-exports every name here); the same rules hold: each private name of torch is
touched here, with what it is for and why no public API serves, and is pinned in ``tests/test_compat.py``.

Something that counts what a training step's forwards did (the tokens each expert received, for the experts' bias)
must count each micro-batch once, but a module's forward also runs

- again inside backward, where activation checkpointing recomputes it (torch.utils.checkpoint, both forms), and
- on made-up inputs, once per stage, where torch's pipeline schedule infers the shapes a stage sends and receives
  (its first training step, and the first after each switch between eval and train).

Neither says so through a public API. :func:`counted_forward` answers for both.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim._muon as _muon

_INFERRING = threading.local()


def in_backward() -> bool:
    """Whether this thread is running autograd's backward now (a checkpointed forward recomputed there is).
    ``torch._C._current_graph_task_id()`` is -1 outside a backward: what ``torch.autograd.graph``'s own multi-grad
    hooks read (torch 2.11 and 2.13); no public function says it."""
    return torch._C._current_graph_task_id() != -1


def watch_metadata_inference(stage: Any) -> None:
    """Mark, on this thread, the calls in which torch's ``PipelineStage`` infers its shapes on made-up inputs: its
    ``_prepare_forward_infra`` and ``_prepare_backward_infra`` (the schedule calls them before the micro-batches on
    the first step, and again after an eval/train switch; torch 2.11 and 2.13 alike). Their forward (and
    backward) of the stage's module are not a step's."""
    for name in ("_prepare_forward_infra", "_prepare_backward_infra"):
        method = getattr(stage, name, None)
        if method is None or getattr(method, "_cuboid_marked", False):
            continue

        @functools.wraps(method)
        def marked(*args: Any, __method: Any = method, **kwargs: Any) -> Any:
            depth = getattr(_INFERRING, "depth", 0)
            _INFERRING.depth = depth + 1
            try:
                return __method(*args, **kwargs)
            finally:
                _INFERRING.depth = depth

        marked._cuboid_marked = True  # type: ignore[attr-defined]
        setattr(stage, name, marked)


def in_metadata_inference() -> bool:
    """Whether a pipeline stage watched by :func:`watch_metadata_inference` is inferring its shapes now."""
    return getattr(_INFERRING, "depth", 0) > 0


def counted_forward() -> bool:
    """Whether a forward running now is one a training step counts: not a recompute inside backward, not a
    pipeline's shape inference. (Gradients may be off: a reentrant checkpoint runs its forward under no_grad and
    only its recompute with them; the caller tells training from evaluation by ``module.training``.)"""
    return not in_backward() and not in_metadata_inference()


# --- torch's Muon ---


@contextmanager
def muon_newton_schulz(fn: Callable[..., Any]) -> Generator[None, None, None]:
    """While inside: ``torch.optim.Muon`` orthogonalizes each update with ``fn`` (same signature). torch's Muon step
    calls the module function ``torch.optim._muon._zeropower_via_newtonschulz(update, ns_coefficients, ns_steps,
    eps)`` for each matrix (torch 2.11 and 2.13); it has no public hook for it."""
    before = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = fn
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = before


# torch's own function, bfloat16 inside (what the context above stands in for)
muon_newton_schulz.original = _muon._zeropower_via_newtonschulz  # type: ignore[attr-defined]


def unhooked_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer class's ``step`` without the hook wrapper torch puts on it once an instance exists
    (``Optimizer._patch_step_function``: ``profile_hook_step``, marked ``hooked``), for a subclass's ``step`` that
    calls its parent's: the subclass's own wrapper runs the step hooks once, the parent's would run them again."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]
