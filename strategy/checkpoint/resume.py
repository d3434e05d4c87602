"""Resuming: the newest complete checkpoint of a directory, what a checkpoint restores (so that it is not initialised
first), and the batches a mid-epoch resume skips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from cuboid.adapters import frozen_base_names
from cuboid.checkpoint.format import META_FILE
from cuboid.checkpoint.sharded import is_sharded_checkpoint


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` (what ``ckpt_path="auto"`` resumes from), or None.

    Complete: a sharded checkpoint directory with its metadata, or a ``checkpoint_format="full"`` file; temporary
    (``.<name>.tmp``) and replaced (``.<name>.old``) ones are skipped, and a ``last`` link counts as its target.
    Newest: by the time its metadata was written.
    """
    found = checkpoints_newest_first(directory)
    return found[0] if found else None


def checkpoints_newest_first(directory: str | Path) -> list[Path]:
    """Every complete checkpoint in ``directory`` (as :func:`latest_checkpoint` counts them), newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found: dict[Path, float] = {}
    for entry in root.iterdir():
        if entry.name.startswith(".") or not entry.name.endswith(".ckpt"):
            continue
        target = entry.resolve()
        if is_sharded_checkpoint(target):
            found[target] = (target / META_FILE).stat().st_mtime
        elif target.is_file():
            found[target] = target.stat().st_mtime
    return sorted(found, key=found.__getitem__, reverse=True)


def restored_names(module: nn.Module) -> set[str]:
    """The names a checkpoint of ``module`` sets when loaded strictly: its parameters and persistent buffers, as
    ``state_dict`` names them, less a PEFT model's frozen base (an adapter's checkpoint does not store it). A
    non-persistent buffer is not among them: it is initialised even when a checkpoint comes."""
    return set(nn.Module.state_dict(module, keep_vars=True)) - frozen_base_names(module)


class SkipFirstBatches:
    """Wraps a train DataLoader so its next epoch starts ``skip`` batches in (mid-epoch resume).

    The skipped batches are drawn and dropped, so the sampler (seeded per epoch) hands every rank the
    same samples after resume as in the uninterrupted run. Later epochs are not affected. Has
    ``state_dict``/``load_state_dict`` so Lightning treats it as resumable.
    """

    def __init__(self, loader: Any, skip: int, epoch: int) -> None:
        self._loader, self._skip, self._epoch = loader, skip, epoch

    def __iter__(self) -> Any:
        skip, self._skip = self._skip, 0
        if skip:
            # Lightning creates the iterator before it sets the sampler's epoch: set it, or a resumed
            # epoch > 0 would be shuffled like epoch 0.
            from cuboid.compat import set_sampler_epoch

            set_sampler_epoch(self._loader, self._epoch)
        iterator = iter(self._loader)
        for _ in range(skip):
            next(iterator, None)
        return iterator

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
