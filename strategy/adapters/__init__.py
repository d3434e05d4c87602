"""Adapters: PEFT's LoRA layers inside a sharded model (which tensors are the adapter's, the base's names in
its own files and in PEFT's adapter files, PEFT's own init on meta)."""

from cuboid.adapters.lora import (
    adapter_configs,
    base_name,
    frozen_base_names,
    init_adapters,
    is_adapter_name,
    is_lora_layer,
    peft_models,
    peft_state_dict,
    write_peft_adapters,
)

__all__ = [
    "adapter_configs",
    "base_name",
    "frozen_base_names",
    "init_adapters",
    "is_adapter_name",
    "is_lora_layer",
    "peft_models",
    "peft_state_dict",
    "write_peft_adapters",
]
