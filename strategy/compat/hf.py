"""transformers' own renamings of saved weights, read through its loading code (``transformers.conversion_mapping``
and ``transformers.core_model_loading``: modules of transformers 5, pinned in tests/test_compat.py)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def saved_names(model: nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """For a transformers model, ``{its parameter's name: the key in keys}`` where transformers renames saved keys
    on load (its checkpoint conversion mapping: LLaVA's ``language_model.model.layers.0...`` in its files is
    ``model.language_model.layers.0...`` in the model); keys it would also convert (fuse, split) are left out.
    Empty for another model, or one transformers does not rename."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    transforms = get_model_conversion_mapping(model)
    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    if not renames:
        return {}
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = dict.fromkeys(model.state_dict())  # (only the names are read: whether a prefix is added or dropped)
    found: dict[str, str] = {}
    for key in keys:
        renamed, converted = rename_source_key(key, renames, converters, model.base_model_prefix, names)
        if converted is None and renamed != key:
            found[renamed] = key
    return found
