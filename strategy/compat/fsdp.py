"""FSDP2 undone: a module ``fully_shard`` sharded made plain again, its whole weights on every rank.

FSDP2 has no public inverse of ``fully_shard``. What it installs, and what :func:`unshard_for_good` takes away, read
from torch 2.11-2.13's ``torch/distributed/fsdp/_fully_shard``:

- the class swap: ``_fsdp_init.py`` (``_apply_to_module``... ``module.__class__ = new_cls``, a class ``FSDP<Name>``
  made with bases ``(FSDPModule, cls)``): the class is set back to ``cls``;
- the forward hooks: ``_fsdp_state.py`` ``FSDPState.init`` (``_pre_forward_hook_handle``,
  ``_post_forward_hook_handle``, a ``RemovableHandle`` each, or one ``_MultiHandle`` for a group of modules);
- the state-dict hooks: ``_fsdp_param_group.py`` ``_register_state_dict_hooks``
  (``_module_to_pre_save_state_dict_hook_handle``, ``_module_to_pre_load_state_dict_hook_handle``, each a dict of
  module -> handle) and ``_fsdp_param.py`` (``FSDPParam._post_load_hook_handle``);
- the composable API's registry: ``torch/distributed/_composable/contract.py`` (``module.__dict__[STATE_KEY]``, keyed
  by the ``fully_shard`` function, and ``module.__dict__[REGISTRY_KEY]["fully_shard"]``) and
  ``torch/distributed/_composable_state.py`` (``_module_state_mapping``, module -> weak reference to the state);
- ``register_fsdp_forward_method``: ``_fully_shard.py``, an instance attribute holding a bound
  ``register_fsdp_forward_method.<locals>.wrapped_method`` (its code's qualified name: ``functools.wraps`` gives
  the function the wrapped method's).

``tests/test_compat.py`` pins each of these names, so a torch that moves one fails there first.

Tensor parallel's ``parallelize_module`` keeps no handles for the forward hooks it registers
(``torch/distributed/tensor/_api.py`` ``distribute_module``: ``module.register_forward_pre_hook(lambda ...)``).
:func:`hook_keys` reads the keys of a module's forward-hook tables (``nn.Module._forward_pre_hooks``,
``_forward_hooks`` and their ``_with_kwargs`` / ``_always_called`` companions, ``torch/nn/modules/module.py``), so
that the hooks a build added can be told apart and :func:`drop_hooks` can take them away as ``RemovableHandle.remove``
does (``torch/utils/hooks.py``: the key deleted from the table and from each companion). ``distribute_module``
also marks each module it parallelized (``module._distribute_module_applied = True``, and refuses a marked one):
:func:`unshard_for_good` takes the mark away with the DTensors, so tensor parallel can split the module again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from cuboid.compat.distributed import full_tensor

_WRAPPED_METHOD = "register_fsdp_forward_method.<locals>.wrapped_method"
_DISTRIBUTED_MARK = "_distribute_module_applied"  # torch/distributed/tensor/_api.py distribute_module


# What DTensor's dispatch raises when an op meets a DTensor beside a plain tensor (torch/distributed/tensor/
# _dispatch.py, ``_try_replicate_spec_for_scalar_tensor``: "{op}: got mixed torch.Tensor and DTensor, need to convert
# all torch.Tensor to DTensor ..."): a module's own method reading sharded weights (cuboid.dropin.kept). Pinned.
MIXED_TENSORS = "got mixed torch.Tensor and DTensor"


def fsdp_units(root: nn.Module) -> list[nn.Module]:
    """The modules under ``root`` (itself included) that ``fully_shard`` was applied to."""
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
_COMPANIONS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def hook_keys(root: nn.Module) -> dict[nn.Module, dict[str, set[int]]]:
    """Each module under ``root`` -> its forward-hook tables' keys, by table name."""
    return {module: {table: set(getattr(module, table)) for table in _HOOK_TABLES} for module in root.modules()}


def drop_hooks(added: dict[nn.Module, dict[str, set[int]]]) -> None:
    """Remove the forward hooks ``added`` names (what :func:`hook_keys` read after a build, less what it read
    before), as their ``RemovableHandle.remove`` would."""
    for module, tables in added.items():
        for table, keys in tables.items():
            for key in keys:
                getattr(module, table).pop(key, None)
                for companion in _COMPANIONS:
                    getattr(module, companion, {}).pop(key, None)


def unshard_for_good(root: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Make every ``fully_shard`` unit under ``root`` a plain module of its own class again, each parameter (and
    DTensor buffer: tensor parallel's) whole on ``device`` (a new ``nn.Parameter``, its ``requires_grad`` kept; tied parameters stay tied). A collective
    over each parameter's mesh, in parameter order: every rank of the mesh calls it. Returns the new parameters by
    the ``id`` of the ones they replace."""
    units = fsdp_units(root)
    for unit in units:
        unit.reshard()  # the fp32 shards in place (no collective): never a mixed-precision gathered copy
    whole: dict[int, nn.Parameter] = {}
    for _, param in root.named_parameters(remove_duplicate=True):
        data = full_tensor(param) if isinstance(param, DTensor) else param.detach()
        whole[id(param)] = nn.Parameter(data.to(device).clone(), requires_grad=param.requires_grad)
    for unit in units:
        _drop_fsdp(unit)
    for module in root.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in whole:
                module._parameters[name] = whole[id(param)]
        for name, buffer in list(module._buffers.items()):
            if isinstance(buffer, DTensor):  # (collective too: buffers in module order, the same on every rank)
                module._buffers[name] = full_tensor(buffer).to(device)
        module.__dict__.pop(_DISTRIBUTED_MARK, None)  # tensor parallel's "applied once" mark
    return whole


def _drop_fsdp(unit: nn.Module) -> None:
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping

    state = unit._get_fsdp_state()  # type: ignore[operator]
    handles = {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle) if h is not None}
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; 2.11 keeps one, _fsdp_param_group
    for group in groups if groups is not None else [g for g in [state._fsdp_param_group] if g is not None]:
        for table in (
            group._module_to_pre_save_state_dict_hook_handle,
            group._module_to_pre_load_state_dict_hook_handle,
        ):
            handles.update((id(h), h) for h in table.values())
            table.clear()
        handles.update((id(p._post_load_hook_handle), p._post_load_hook_handle) for p in group.fsdp_params)
    for handle in handles.values():
        handle.remove()
    for name, value in list(vars(unit).items()):
        code = getattr(getattr(value, "__func__", None), "__code__", None)  # (functools.wraps renames the function)
        if code is not None and code.co_qualname == _WRAPPED_METHOD:
            del unit.__dict__[name]  # register_fsdp_forward_method's wrapper: the class's own method again
    for key in (STATE_KEY, REGISTRY_KEY):
        table: Any = unit.__dict__.get(key)
        if isinstance(table, dict):
            for entry in [k for k, v in table.items() if v is state or getattr(k, "__name__", k) == "fully_shard"]:
                del table[entry]
            if not table:
                del unit.__dict__[key]
    _module_state_mapping.pop(unit, None)
    (plain,) = [base for base in type(unit).__bases__ if not issubclass(base, FSDPModule)]
    unit.__class__ = plain
