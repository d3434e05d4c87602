"""Non-finite losses and gradients: stop with the step and the ranks named, or skip the update on every rank.

``CuboidStrategy(nonfinite="raise" | "skip")``. After the step's backward (and clipping), before the optimizer
step, every rank contributes two flags (its loss is not finite; the global gradient norm is not finite), gathered
over all ranks in one collective and read once on the host: one host sync per optimizer step, which is why the
default (``None``) checks nothing. ``"raise"`` stops every rank with :class:`NonFiniteError` before the weights
change; ``"skip"`` drops this optimizer step on every rank together (gradients are zeroed as usual, AdamW's
state and step count untouched) and warns. Either way no update, and so no checkpoint, ever comes from
non-finite values.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from cuboid import compat

Mode = Literal["raise", "skip"]


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm that is NaN or infinite; the message names the step and the ranks."""


class NonFiniteGuard:
    def __init__(self, mode: Mode | None) -> None:
        if mode not in (None, "raise", "skip"):
            raise ValueError(f"nonfinite={mode!r}; choose None (no check), 'raise' or 'skip'.")
        self.mode = mode
        self.skipped: list[int] = []  # global steps whose update was skipped

    @property
    def enabled(self) -> bool:
        return self.mode is not None

    def step_is_finite(self, loss: Any, grad_norm: torch.Tensor | None, step: int, device: torch.device) -> bool:
        """Whether every rank's loss and the gradient norm are finite (a collective; every rank calls it)."""
        flags = torch.zeros(2, device=device)
        if isinstance(loss, torch.Tensor):
            flags[0] = (~torch.isfinite(loss.detach().float())).any().float()
        if grad_norm is not None:
            flags[1] = (~torch.isfinite(grad_norm.detach().float().to(device))).float()
        if dist.is_initialized():
            gathered = torch.empty(dist.get_world_size() * 2, device=device)
            compat.all_gather_single(gathered, flags)
        else:
            gathered = flags
        per_rank = gathered.view(-1, 2).tolist()  # the one host read of the step
        bad_loss = [r for r, (lo, _) in enumerate(per_rank) if lo]
        bad_norm = any(n for _, n in per_rank)
        if not bad_loss and not bad_norm:
            return True
        what = []
        if bad_loss:
            what.append(f"the loss is NaN or infinite on rank(s) {bad_loss}")
        if bad_norm:
            what.append("the global gradient norm is NaN or infinite")
        message = f"step {step}: {' and '.join(what)}"
        if self.mode == "raise":
            raise NonFiniteError(
                f"{message}. Stopped before the optimizer step: the weights (and the last checkpoint) are from the "
                "step before. Lower the learning rate, check the batch on those ranks, or pass "
                "nonfinite='skip' to drop such steps."
            )
        self.skipped.append(step)
        rank_zero_warn(f"Cuboid: {message}; the optimizer step was skipped on every rank (nonfinite='skip').")
        return False
