"""Hyper-parameters in a checkpoint: what can be stored is, what cannot is left out with a warning.

A LightningModule that calls ``self.save_hyperparameters()`` with a module among its arguments (the network a Hydra
config instantiates and passes in) keeps that module in ``hparams``. Under DDP the checkpoint pickles it whole. Under
Cuboid the same object has been sharded in place: ``fully_shard`` gave it a class made at run time
(``FSDP<Name>``) that pickle cannot find, and its weights are DTensor shards that the checkpoint already holds
by name. Lightning itself advises ``save_hyperparameters(ignore=[...])`` for modules; Cuboid turns that advice into
a warning instead of a crash.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")  # Lightning's checkpoint keys
_warned: set[tuple[str, str]] = set()


def _why_not_storable(value: Any) -> str | None:
    if isinstance(value, nn.Module):
        return f"it holds a module ({type(value).__name__}), whose weights the checkpoint already stores by name"
    try:
        pickle.dumps(value)
    except Exception as err:  # what pickle raises varies: PicklingError, TypeError, AttributeError
        return f"it cannot be pickled ({type(err).__name__}: {err})"
    return None


def storable_hparams(state: dict[str, Any]) -> list[str]:
    """Replace ``state``'s hyper-parameter mappings by copies without the entries that cannot be stored; return
    their names (each warned about once per process). The module's own ``hparams`` are not touched."""
    left_out = []
    for key in HPARAM_KEYS:
        hparams = state.get(key)
        if not isinstance(hparams, Mapping) or type(hparams).__module__.startswith("omegaconf"):
            continue  # an OmegaConf container holds no modules (OmegaConf refuses them)
        kept = {}
        for name, value in hparams.items():
            reason = _why_not_storable(value)
            if reason is None:
                kept[name] = value
                continue
            left_out.append(name)
            if (key, name) not in _warned:
                _warned.add((key, name))
                rank_zero_warn(
                    f"Cuboid: the hyper-parameter {name!r} is left out of checkpoints: {reason}. To load one with "
                    f"`load_from_checkpoint`, pass it again (`load_from_checkpoint(path, {name}=...)`); to silence "
                    f"this, `self.save_hyperparameters(ignore=[{name!r}])`."
                )
        state[key] = type(hparams)(kept) if type(hparams) is not dict and _rebuildable(hparams) else kept
    return left_out


def _rebuildable(hparams: Mapping[str, Any]) -> bool:
    try:
        type(hparams)({})
    except Exception:
        return False
    return True
