"""Which kind of forward is running: a step's own, a recompute inside backward, or a pipeline's metadata inference.

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
from typing import Any

import torch

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
