"""Lightning's own checkpoint formats, both ways: so a project can come to Cuboid mid-run, and leave it.

Plain Lightning (DDP, single device) and ``ModelParallelStrategy``/``FSDPStrategy`` full files hold the
LightningModule's ``state_dict`` and ``optimizer_states``: one ``torch.optim`` state dict per optimizer,
keyed by parameter *position*. Cuboid reads and reshards by parameter *name*, so this module maps
positions to names and back:

* a position is a parameter's index in the optimizer's ``param_groups`` (concatenated), the way
  ``optimizer.state_dict()`` numbers them; ``ModelParallelStrategy`` numbers by ``model.parameters()``
  and lists those numbers in each group, so both are read through the saved groups' ``params`` lists;
* under pipeline parallelism each rank's optimizer holds its stages' parameters only: the global order
  of a group is the model's parameter order (recorded before the split) restricted to that group, which
  is what one process would have built from ``self.parameters()``.

Cuboid's ``checkpoint_format="full"`` writes ``optimizer_states`` this way too, so plain Lightning
resumes it, optimizer included. ``ModelParallelStrategy`` and ``FSDPStrategy`` sharded directories
(DCP, with ``state_dict.*`` or ``model.*`` entries and nested optimizer states) load through DCP.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from cuboid.checkpoint.format import META_FILE, RNG_DIR, CheckpointError, LoadRequest, check_loadable, load_pickled
from cuboid.checkpoint.sharded import is_sharded_checkpoint

Groups = list[list[str]]  # per param group, the parameter names in the optimizer's (global) order


class FormatError(ValueError):
    """A Lightning checkpoint whose optimizer state does not fit this LightningModule's optimizers."""


def optimizer_groups(
    module: nn.Module, optimizers: Sequence[Optimizer], model_order: Sequence[str] | None = None
) -> list[Groups]:
    """Per optimizer, per param group, the names of its parameters in global position order.

    ``model_order`` (the model's parameter names before a pipeline split): the ranks hold different
    parameters, so every rank's groups are gathered (one object collective) and ordered by it.
    """
    names = {id(p): n for n, p in module.named_parameters()}  # a tied parameter: its first name, as torch keys it
    local = [[[names[id(p)] for p in group["params"]] for group in opt.param_groups] for opt in optimizers]
    if model_order is None or not dist.is_initialized():
        return local
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    rank_of = {name: i for i, name in enumerate(model_order)}
    merged: list[Groups] = []
    for o, opt_groups in enumerate(local):
        groups: Groups = []
        for g in range(len(opt_groups)):
            held = {n for theirs in everyone for n in theirs[o][g]}
            groups.append(sorted(held, key=lambda n: rank_of.get(n, len(rank_of))))
        merged.append(groups)
    return merged


def _split_key(rest: str, names: set[str]) -> tuple[str, str]:
    """``"<param name>.<state key>"`` -> (name, key); names contain dots, so match the longest known name."""
    head, _, tail = rest.rpartition(".")
    if head in names:
        return head, tail
    for name in sorted(names, key=len, reverse=True):
        if rest.startswith(name + "."):
            return name, rest[len(name) + 1 :]
    raise FormatError(f"optimizer entry {rest!r} names no parameter of this model")


def to_positional(flat: dict[str, Any], groups: Groups, hyper: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Flattened optimizer state by name (``state.<name>.<key>``) -> ``torch.optim``'s format by position.

    ``hyper``: each group's hyper-parameters (lr, betas, ...), as the live optimizer holds them.
    """
    position = {name: i for i, name in enumerate(n for group in groups for n in group)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if not key.startswith("state."):
            continue
        name, entry = _split_key(key[len("state.") :], set(position))
        state.setdefault(position[name], {})[entry] = value
    param_groups = [{**dict(h), "params": [position[n] for n in group]} for h, group in zip(hyper, groups, strict=True)]
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def from_positional(osd: dict[str, Any], groups: Groups, where: str) -> dict[str, Any]:
    """``torch.optim``'s format by position -> flattened by name (what Cuboid loads through DCP)."""
    saved = osd.get("param_groups")
    if not isinstance(saved, list) or not isinstance(osd.get("state"), dict):
        raise FormatError(f"{where}: an optimizer state without 'state' and 'param_groups' (not torch.optim's format)")
    sizes = [len(g.get("params", [])) for g in saved]
    if sizes != [len(g) for g in groups]:
        raise FormatError(
            f"{where}: the checkpoint's optimizer has param groups of {sizes} parameters, this LightningModule's "
            f"configure_optimizers builds {[len(g) for g in groups]}. Load it with the optimizer it was saved with."
        )
    name_of = {
        pos: name for g, group in zip(saved, groups, strict=True) for pos, name in zip(g["params"], group, strict=True)
    }
    flat: dict[str, Any] = {}
    for pos, entries in osd["state"].items():
        if pos not in name_of:
            raise FormatError(f"{where}: optimizer state for parameter position {pos!r}, which no param group lists")
        for key, value in entries.items():
            flat[f"state.{name_of[pos]}.{key}"] = value
    for g, group in zip(saved, groups, strict=True):
        for name in group:
            for key, value in g.items():
                if key != "params":
                    flat[f"param_groups.{name}.{key}"] = value
    return flat


def _foreign_model_key(stored: set[str]) -> str | None:
    """For a DCP directory: ``"state_dict"`` (ModelParallelStrategy), ``"model"`` (FSDPStrategy, Cuboid), else None."""
    for key in ("state_dict", "model"):
        if any(k.startswith(key + ".") for k in stored):
            return key
    return None


def _load_foreign_sharded(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], model_key: str, strict: bool
) -> None:
    """Load a ModelParallelStrategy / FSDPStrategy sharded directory (nested optimizer states, by name)."""
    stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    has_optim = any(k.startswith("optimizer_") for k in stored)
    state: dict[str, Any] = {model_key: get_model_state_dict(module)}
    if has_optim:
        state.update({f"optimizer_{i}": get_optimizer_state_dict(module, opt) for i, opt in enumerate(optimizers)})
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state[model_key], options=StateDictOptions(strict=strict))
    if has_optim:
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"])


class LightningFormat:
    """The DCP directories of Lightning's ModelParallelStrategy (``state_dict.*``) and FSDPStrategy
    (``model.*``), read into any Cuboid layout: a project can come to Cuboid mid-run. (Their full files are
    Lightning checkpoints, which :class:`~cuboid.checkpoint.full.FullFormat` reads.)"""

    name = "lightning"

    def recognizes(self, path: Path) -> bool:
        return is_sharded_checkpoint(path) and not (path / RNG_DIR).is_dir()  # Cuboid's always has rng/

    def load(self, request: LoadRequest) -> dict[str, Any]:
        path = request.path
        check_loadable(path)
        stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        meta = load_pickled(path / META_FILE, request.weights_only)
        key = _foreign_model_key(stored)
        if key is None:
            raise CheckpointError(
                f"{path} is a DCP directory with neither 'state_dict.*' (ModelParallelStrategy) nor 'model.*' "
                "(FSDPStrategy, Cuboid) entries: not a Lightning checkpoint."
            )
        try:
            _load_foreign_sharded(path, request.module, request.optimizers, key, request.strict)
        except Exception as err:  # DCP wraps per-rank failures: say which checkpoint, nothing else
            raise CheckpointError(f"could not load {path} (a Lightning {key!r} checkpoint): {err}") from err
        return meta
