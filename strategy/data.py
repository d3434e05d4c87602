"""``cuboid.data``: the main job's data module under the name Hydra configs and scripts already use
(``_target_: cuboid.data.TokenDataModule``, ``from cuboid.data import TokenDataModule``). It lives with the main job,
in :mod:`cuboid.train.data` (through the wing's face, :mod:`cuboid.train`)."""

from cuboid.train import (
    DEFAULT_PATTERNS,
    DataError,
    TokenDataModule,
    TokenWindows,
    load_tokens,
    prepare_tokens,
    stdlib_sources,
)

__all__ = [
    "DEFAULT_PATTERNS",
    "DataError",
    "TokenDataModule",
    "TokenWindows",
    "load_tokens",
    "prepare_tokens",
    "stdlib_sources",
]
