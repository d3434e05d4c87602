"""Which context-parallel runtime's step is running: the transformers attention hook (:mod:`cuboid.context.hf`)
asks, the runtime (:mod:`cuboid.context.runtime`) says, so neither imports the other's module for it."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

KEY_PADDING = "cuboid_key_padding"  # the keyword under which a transformers model carries the whole padding mask
_RUNNING: list[Any] = []  # the ContextParallel runtimes whose steps are running, innermost last


def active() -> Any:
    """The :class:`~cuboid.context.ContextParallel` whose step is running, if any."""
    return _RUNNING[-1] if _RUNNING else None


@contextmanager
def running(runtime: Any) -> Generator[None, None, None]:
    """``runtime``'s step runs inside."""
    _RUNNING.append(runtime)
    try:
        yield
    finally:
        _RUNNING.pop()
