"""torch.optim's internals that Muon across shards relies on.

Part of :mod:`cuboid.compat` (which re-exports every name here); the same rules hold: each private name of torch is
touched here, with what it is for and why no public API serves, and is pinned in ``tests/test_compat.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch.optim._muon as _muon


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
