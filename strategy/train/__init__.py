"""Cuboid's main job (Hydra): train a Llama-style model with CuboidStrategy.

    python -m cuboid.train                                           # debug model, 2 CPU processes
    python -m cuboid.train strategy=fsdp_tp trainer.devices=4 model=debug
    python -m cuboid.train --help                                    # the config groups and every key

The job itself is :mod:`cuboid.train.job` (Hydra, imported when one of its names is first asked for); its data module
is :mod:`cuboid.train.data` (``cuboid.data``), which imports no Hydra.
"""

from __future__ import annotations

import importlib
from typing import Any

from cuboid.train.data import (  # noqa: F401  (the data module, through the face: cuboid.data)
    DEFAULT_PATTERNS,
    DataError,
    TokenDataModule,
    TokenWindows,
    load_tokens,
    prepare_tokens,
    stdlib_sources,
)

_JOB = ("LossHistory", "WANDB_ID_FILE", "check_config", "layout_of", "main", "make_logger", "resolve_ckpt_path", "run")
_DATA = ["DEFAULT_PATTERNS", "DataError", "TokenDataModule", "TokenWindows", "load_tokens", "prepare_tokens",
         "stdlib_sources"]  # fmt: skip
__all__ = [*_JOB, *_DATA]


def __getattr__(name: str) -> Any:
    if name in _JOB:
        return getattr(importlib.import_module("cuboid.train.job"), name)
    raise AttributeError(f"module 'cuboid.train' has no attribute {name!r}")
