"""Weight averaging on a model sharded over the data-parallel ranks, as under DDP.

A module's own exponential moving average keeps plain, whole tensors and copies them into its parameters (or
reads its parameters into them) outside the step: ``ema.mul_(d).add_(p)``, ``p.copy_(ema)`` when validation
starts. Lightning's ``WeightAveraging`` (``EMAWeightAveraging``) and ``StochasticWeightAveraging`` callbacks do the
same with a whole copy of the LightningModule made before the strategy's setup. Sharded by FSDP2, each parameter
outside the step is a DTensor holding this rank's slice, and torch refuses an operation that mixes it with a plain
tensor ("got mixed torch.Tensor and DTensor").

When the model is sharded over the data-parallel ranks only, Cuboid shards the callbacks' whole copy as the live
model is sharded (:func:`shard_alike`: each rank keeps its own slices of the copy, no collective), so each of their
updates, swaps and copies is between two DTensors placed alike, a local operation on each rank's slices: what
DDP computes on whole tensors. A checkpoint written in the full format then carries the average where Lightning's
callback puts it (``state_dict``, the live weights under ``current_model_state``), gathered as DDP writes it;
the sharded format cannot (refused at setup, naming ``checkpoint_format="full"``). Under a layout that splits the
model otherwise (tp, pp, cp, ep) the copy does not line up with a rank's parameters: refused at setup by name
(:func:`check_averaging`). A module's own average kept in plain tensors outside Lightning's callbacks still meets
torch's "mixed torch.Tensor and DTensor" when it copies into a sharded parameter: make its copies from the
parameters after setup (``on_fit_start``: ``[p.detach().clone() for p in self.parameters()]``, DTensors placed
alike), or use ``EMAWeightAveraging``.

:func:`accept_whole_state_dicts` (the live sharded model's, and the copy's): ``load_state_dict`` takes whole
tensors, as DDP-era code hands them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from cuboid import compat


class AveragingError(ValueError):
    """Weight averaging a layout cannot give DDP's numbers for: what is wrong and what to do."""


def averaging_callbacks(callbacks: Iterable[Any]) -> list[Any]:
    """Lightning's weight-averaging callbacks among ``callbacks`` (either package's: by class name)."""
    names = {"WeightAveraging", "StochasticWeightAveraging"}
    return [cb for cb in callbacks if names & {cls.__name__ for cls in type(cb).__mro__}]


def check_averaging(callbacks: Iterable[Any], split: str | None, sharded_files: bool) -> None:
    """Refuse Lightning's averaging callbacks when the layout splits the model otherwise than over the
    data-parallel ranks (``split``: how, in words; None when it does not), and ``WeightAveraging`` when checkpoints
    are written in the sharded format (``sharded_files``), which cannot hold its average as Lightning does."""
    found = averaging_callbacks(callbacks)
    weighting = [cb for cb in found if "WeightAveraging" in {cls.__name__ for cls in type(cb).__mro__}]
    if weighting and sharded_files and split is None:
        raise AveragingError(
            f"Trainer(callbacks=[{type(weighting[0]).__name__}(...)]) writes its average into each checkpoint's "
            "state_dict and the live weights under current_model_state, as Lightning's DDP writes one file; "
            "CuboidStrategy(checkpoint_format='sharded') writes the live model's shards. Set "
            "CuboidStrategy(checkpoint_format='full'), or save no checkpoints (enable_checkpointing=False)."
        )
    if found and split is not None:
        names = ", ".join(type(cb).__name__ for cb in found)
        raise AveragingError(
            f"Trainer(callbacks=[{names}(...)]) keeps a whole copy of the model and averages the live parameters into "
            f"it, but this layout's {split}: a rank's parameters are not the whole model's. Average under data "
            "parallel only (Cuboid's default, or data_parallel_shard / data_parallel_replicate), or remove the callback."
        )


def shard_alike(copy: nn.Module, live: nn.Module) -> int:
    """Make each parameter of ``copy`` (a whole copy of ``live`` made before sharding, the same names) a DTensor
    placed as ``live``'s is: each rank keeps its own slices of the copy's whole tensor, no collective. Its
    ``load_state_dict`` takes whole tensors too. How many it sharded."""
    held = dict(copy.named_parameters())
    done = 0
    for name, target in live.named_parameters():
        mine = held.get(name)
        if not isinstance(target, DTensor) or mine is None or isinstance(mine, DTensor):
            continue
        owner, _, leaf = name.rpartition(".")
        value = mine.detach().to(target.to_local().device, target.dtype)
        sharded = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
        setattr(copy.get_submodule(owner), leaf, nn.Parameter(sharded, requires_grad=mine.requires_grad))
        done += 1
    accept_whole_state_dicts(copy)
    return done


def own_copies(root: nn.Module) -> list[tuple[str, Any, list[DTensor]]]:
    """The module's own copies of its parameters: an attribute of ``root`` or of one of its submodules holding a
    list, tuple or dict of plain tensors, one for each parameter of that module (or of a module under it), in
    order and of the same shapes (``self.ema = [p.detach().clone() for p in self.net.parameters()]``; a dict keyed
    by the parameters' names). ``(where, container, the parameters they copy)`` for each, once the parameters are
    DTensors."""
    found = []
    for path, owner in root.named_modules():
        for attribute, value in vars(owner).items():
            if attribute.startswith("_") or not isinstance(value, (list, tuple, dict)) or not value:
                continue
            tensors = list(value.values()) if isinstance(value, dict) else list(value)
            if not all(type(t) is torch.Tensor for t in tensors):
                continue
            for _, candidate in owner.named_modules():
                named = dict(candidate.named_parameters())
                params = [named.get(k) for k in value] if isinstance(value, dict) else list(named.values())
                shapes = [tuple(t.shape) for t in tensors] == [
                    tuple(p.shape) if p is not None else None for p in params
                ]
                if shapes and all(isinstance(p, DTensor) for p in params):
                    found.append((f"{path}.{attribute}" if path else attribute, value, params))
                    break
    return found


def shard_own_copies(root: nn.Module) -> list[str]:
    """Each of the module's own copies of its parameters (:func:`own_copies`) sharded as those parameters are, in
    place (a tuple replaced): its updates from the parameters and copies into them are then between DTensors placed
    alike. Where they were, by name."""
    names = []
    for where, container, params in own_copies(root):
        keys = list(container) if isinstance(container, dict) else range(len(container))
        sharded = [distribute_tensor(container[k].detach().to(p.to_local().device, p.dtype), p.device_mesh,
                                     p.placements, src_data_rank=None) for k, p in zip(keys, params, strict=True)]  # fmt: skip
        if isinstance(container, tuple):
            owner, _, attribute = where.rpartition(".")
            setattr(root.get_submodule(owner), attribute, tuple(sharded))
        else:
            for k, value in zip(keys, sharded, strict=True):
                container[k] = value
        names.append(where)
    return names


def whole_own_copies(root: nn.Module) -> None:
    """After the run, every DTensor in the module's list, tuple or dict attributes whole on the CPU again."""
    for owner in root.modules():
        for attribute, value in list(vars(owner).items()):
            if attribute.startswith("_") or not isinstance(value, (list, tuple, dict)):
                continue
            keys = list(value) if isinstance(value, dict) else range(len(value))
            if not any(isinstance(value[k], DTensor) for k in keys):
                continue
            whole = [compat.full_tensor(value[k]).cpu() if isinstance(value[k], DTensor) else value[k] for k in keys]
            if isinstance(value, tuple):
                setattr(owner, attribute, tuple(whole))
            else:
                for k, tensor in zip(keys, whole, strict=True):
                    value[k] = tensor


def make_whole(copy: nn.Module) -> None:
    """After the run, ``copy``'s parameters whole on the CPU again, as the live model's (a collective for each)."""
    for name, param in list(copy.named_parameters()):
        if isinstance(param, DTensor):
            owner, _, leaf = name.rpartition(".")
            whole = nn.Parameter(compat.full_tensor(param).cpu(), requires_grad=param.requires_grad)
            setattr(copy.get_submodule(owner), leaf, whole)


def whole_weights(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with every DTensor made whole on the CPU, as a full checkpoint holds it. A collective for
    each DTensor: every rank calls it, with the same names."""
    return {k: compat.full_tensor(v).cpu() if isinstance(v, DTensor) else v for k, v in state.items()}


class ShardedAgain(Callback):
    """Put ahead of Lightning's averaging callbacks: every FSDP unit sharded again before their hooks read the
    parameters. An evaluation forward leaves a unit that keeps its parameters gathered after forward (the root)
    holding whole plain tensors until the next backward; the callbacks' copy is placed as the sharded ones."""

    def _reshard(self, pl_module: nn.Module) -> None:
        for unit in compat.fsdp_units(pl_module):
            unit.reshard()

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._reshard(pl_module)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._reshard(pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._reshard(pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._reshard(pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._reshard(pl_module)


def put_ahead(callbacks: list[Any]) -> None:
    """Put one :class:`ShardedAgain` ahead of the first of Lightning's averaging callbacks in ``callbacks`` (the
    Trainer's list, which its hooks walk in order)."""
    found = averaging_callbacks(callbacks)
    if found and not any(isinstance(cb, ShardedAgain) for cb in callbacks):
        callbacks.insert(callbacks.index(found[0]), ShardedAgain())


def accept_whole_state_dicts(root: nn.Module) -> None:
    """``load_state_dict`` of the sharded model takes whole tensors too, as DDP-era code hands it
    (``model.load_state_dict(torch.load(best)["state_dict"])``): each whole tensor becomes the DTensor it fills, each
    rank keeping its slices of it (no collective: every rank has the whole tensor). A hook on each module that holds
    DTensors itself, run by ``load_state_dict`` before it copies."""
    for module in root.modules():
        held = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if any(isinstance(value, DTensor) for _, value in held):
            module.register_load_state_dict_pre_hook(_shard_whole)


def _shard_whole(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    for name, target in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        value = state_dict.get(prefix + name)
        whole = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
        if isinstance(target, DTensor) and whole and tuple(value.shape) == tuple(target.shape):
            value = value.to(target.to_local().device, target.dtype)
            state_dict[prefix + name] = distribute_tensor(
                value, target.device_mesh, target.placements, src_data_rank=None
            )
