"""The model as a run leaves it, where Lightning's DDP leaves it: a plain module of the user's own class, its whole
weights on every rank, on the CPU (``DDPStrategy.teardown`` unwraps DDP, then ``Strategy.teardown`` moves the
module to the CPU).

After ``fit`` a library calls its own methods on the model (scvi-tools' ``module.inference``, not ``forward``),
saves ``state_dict()`` for a plain module to load, and pickles it whole (darts, ``torch.save(model)``). On a
sharded model each of those meets DTensors or FSDP2's swapped class ``FSDP<Name>``, which pickle cannot find. So at
the end of a run that finished (every rank there: the gather is a collective), a model FSDP2 sharded over the
data-parallel ranks, or split by Cuboid's own tensor parallel (with or without FSDP2), is made plain again
(:func:`cuboid.compat.fsdp.unshard_for_good`, and the forward hooks the build added dropped); the next ``fit``,
``validate`` or ``test`` shards it anew, as it does a fresh model. A layout that split the model otherwise
(pipeline, context or expert parallel, tensor parallel applied by the user's own ``configure_model``, activation
checkpointing, offloaded shards) stays sharded; so does a model whose whole weights would take more than half of
what each process has in host memory. Pickling one of those is refused by name (:func:`refuse_pickling`), saying
what to call instead.
"""

from __future__ import annotations

import copyreg
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from cuboid import compat
from cuboid.dropin.replicate import capacity, first_asked

HOST_SHARE = 2  # whole weights on the host: at most half of what each process has there


def stays_sharded(module: nn.Module, sizes: dict[str, int], local_processes: int, **asked: Any) -> str | None:
    """Why ``module`` stays sharded after the run (in words), or None: it is made plain. ``sizes``: the degrees
    that keep it sharded when above 1, by argument name; ``asked``: settings that keep it sharded when set."""
    if any(value != 1 for value in sizes.values()):
        return f"{first_asked(sizes, {})} split it otherwise than over the data-parallel ranks"
    found = first_asked({}, asked)
    if found is not None:
        return f"{found} is set"
    need = sum(p.numel() * p.element_size() for p in module.parameters())
    room = capacity(torch.device("cpu"), local_processes)
    if room is not None and need * HOST_SHARE > room:
        return f"its whole weights ({need / 2**30:.1f} GiB) would take more than half of each process's host memory"
    return None


def make_plain(module: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
    """``module``'s FSDP2 units plain again, whole on the CPU, and ``optimizers`` with them: each holds the new
    parameters, its state whole on the CPU too (as DDP's teardown leaves it: a save after ``fit`` writes both).
    A collective: every rank calls it."""
    whole = compat.unshard_for_good(module, torch.device("cpu"))
    for optimizer in optimizers:
        state: dict[Any, Any] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:  # the same order on every rank: each full_tensor is a collective
                entry = optimizer.state.get(param)
                if entry is not None:
                    state[whole.get(id(param), param)] = {k: _whole(v) for k, v in entry.items()}
            group["params"] = [whole.get(id(p), p) for p in group["params"]]
        optimizer.state.clear()  # (a defaultdict, kept: the optimizer's own)
        optimizer.state.update(state)


def _whole(value: Any) -> Any:
    if isinstance(value, DTensor):
        return compat.full_tensor(value).cpu()
    return value.cpu() if isinstance(value, torch.Tensor) else value


def refuse_pickling(module: nn.Module, reason: str) -> None:
    """Pickling a unit of ``module`` that stays sharded raises a ``TypeError`` that says why, and what to do."""
    for unit in compat.fsdp_units(module):
        copyreg.pickle(type(unit), _Refusal(type(unit).__name__, reason))


class _Refusal:
    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason

    def __call__(self, obj: Any) -> Any:
        raise TypeError(
            f"{self.name} cannot be pickled: CuboidStrategy keeps it sharded after the run ({self.reason}), each rank "
            "holding only its slices. Save it with trainer.save_checkpoint(path) and read the whole weights with "
            "cuboid.read_model_weights(path) into a model built anew (with checkpoint_format='full', "
            "Model.load_from_checkpoint(path) reads the file); or train with data and tensor parallel alone, after "
            "which the model is plain again."
        )
