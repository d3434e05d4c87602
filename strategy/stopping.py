"""Agreeing, once per training step, whether to stop, through host memory only.

Lightning 2.6's training loop asks at the start of every step whether rank 0 received SIGTERM
(``_TrainingEpochLoop._broadcast_sigterm_tensor``): a tensor made on the device, broadcast over the default group
(NCCL on GPUs) and read back with ``.item()``, a host sync per step that stalls the launch queue. Cuboid drops it
and asks instead in the strategy's ``on_train_batch_start`` (every step, Lightning 2.5 too), with a MAX all-reduce
of a host integer over a gloo group: every rank learns whether *any* rank was signalled
(SLURM signals every task; a signal to one rank counts too), and nothing waits for the device. What happens then is
Lightning's: every rank raises ``SIGTERMException`` at the same step. Lightning's SIGTERM handler itself is made to
only record the signal: its own broadcast, issued from inside the handler, would pair with whatever collective
the other ranks were running, and its loops would stop the signalled rank alone at the end of its step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from cuboid import compat


def host_group() -> Any:
    """A gloo group of every rank: the default group when it is gloo, else a new one (made by every rank)."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


class StopAgreement:
    """Installed on a Trainer's training loop in place of its per-step SIGTERM broadcast."""

    def __init__(self, trainer: Any, group: Any) -> None:
        self.trainer, self.group = trainer, group
        self.received = False  # set by the signal handler; read only at a step boundary
        self._mark_received: Any = None

    def install(self) -> None:
        """Take over from Lightning; :meth:`check` must then run at the start of every training step."""
        compat.drop_sigterm_broadcast(self.trainer)
        self._mark_received = compat.take_over_sigterm(self.trainer, self._on_signal)

    def _on_signal(self) -> None:
        self.received = True

    def signalled(self) -> bool:
        """Whether any rank was signalled (a collective: every rank calls it at the same point)."""
        flag = torch.tensor([int(self.received)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.tolist()[0])  # host memory

    def check(self) -> None:
        if self.signalled():
            self._mark_received()  # trainer.received_sigterm, now on every rank at once
            raise SIGTERMException()
