"""PEFT adapters (LoRA) inside a model Cuboid shards: which tensors are the adapter's, which the frozen base's, and
the names each has in the base model's own files and in PEFT's adapter files.

Nothing here imports ``peft`` unless the model came from it (``peft`` is an optional extra, ``cuboid[peft]``): a
module is a PEFT model only if ``peft`` was imported to build it. The pieces a layout needs live beside their
concern: the tensor-parallel split of a LoRA layer in :mod:`cuboid.parallel.plans`, the frozen base left out of
checkpoints in :mod:`cuboid.checkpoint.format`, the base read from ``pretrained=`` in
:mod:`cuboid.checkpoint.pretrained`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

# The tensors a LoRA layer adds beside its ``base_layer`` (peft.tuners.lora.LoraLayer.adapter_layer_names, and
# DoRA's magnitude): a parameter under one of these is the adapter's.
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_PART = re.compile(r"\.(" + "|".join(ADAPTER_PARTS) + r")\.([^.]+)(?=\.|$)")
# LoRA initializations that need nothing but random numbers (the others, PiSSA, OLoRA, LoftQ, EVA, read the base
# weights or data when the adapter is created).
PLAIN_INITS = (True, False, "gaussian")


def _peft() -> Any | None:
    return sys.modules.get("peft")


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer (``peft.tuners.lora.LoraLayer``): a ``base_layer`` and its adapters."""
    peft = _peft()
    if peft is None:
        return False
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _lora_layers(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every LoRA layer under ``root``, by name."""
    for name, module in root.named_modules():
        if is_lora_layer(module):
            yield name, module


def peft_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost PEFT models (``peft.PeftModel``, what ``get_peft_model`` returns) under ``root``, by name."""
    peft = _peft()
    if peft is None:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if isinstance(module, peft.PeftModel) and not any(name.startswith(f"{n}.") or not n for n, _ in found):
            found.append((name, module))
    return found


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name (any prefix) is a LoRA adapter's tensor rather than its base layer's."""
    return _PART.search(f".{name}") is not None


def frozen_base_names(root: nn.Module) -> set[str]:
    """The names (as in ``root.named_parameters()``) of the frozen parameters inside PEFT models: the base weights
    an adapter fine-tune leaves as they were loaded. A checkpoint does not store them again."""
    names: set[str] = set()
    for prefix, model in peft_models(root):
        lead = f"{prefix}." if prefix else ""
        names |= {lead + n for n, p in model.named_parameters() if not p.requires_grad and not is_adapter_name(n)}
    return names


def base_name(name: str) -> str:
    """A PEFT model's parameter name as the wrapped model's own files name it: ``base_model.model.`` (PEFT's
    wrappers) and ``.base_layer`` (a LoRA layer's wrapped module) dropped."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def adapter_configs(root: nn.Module) -> dict[str, dict[str, dict[str, Any]]]:
    """Each PEFT model's adapter configurations as plain JSON values: ``{model name: {adapter: config}}``, what a
    checkpoint keeps so that its adapters can be exported without the model."""
    import json

    def plain(value: Any) -> Any:
        return sorted(value) if isinstance(value, (set, frozenset)) else str(value)

    return {
        prefix: {a: json.loads(json.dumps(c.to_dict(), default=plain)) for a, c in model.peft_config.items()}
        for prefix, model in peft_models(root)
    }


def init_adapters(root: nn.Module) -> None:
    """PEFT's own initialization of every LoRA layer's adapters (A as ``nn.Linear`` does or Gaussian, B zero):
    what ``get_peft_model`` did when the adapters were built for real, run after the base model's own init on a
    model built on meta (the base's init would draw the adapters as plain ``nn.Linear`` layers, B not zero)."""
    targets = [(model, dict(model.peft_config)) for _, model in peft_models(root)] or [(root, {})]
    for model, configs in targets:  # LoRA layers outside a PeftModel (inject_adapter_in_model): PEFT's default
        for _, layer in _lora_layers(model):
            embeddings = [a for a in layer.lora_embedding_A.keys() if a not in layer.lora_A]
            for adapter in [*layer.lora_A.keys(), *embeddings]:  # a fixed order: the RNG draws follow it
                init = getattr(configs.get(adapter), "init_lora_weights", True)
                if init not in PLAIN_INITS:
                    raise ValueError(
                        f"LoRA adapter {adapter!r} uses init_lora_weights={init!r}, which reads the base weights "
                        "when the adapter is created: a model built on the meta device has none yet. Build the "
                        "model for real (no meta device, no empty_init), or use init_lora_weights=True or 'gaussian'."
                    )
                layer.reset_lora_parameters(adapter, init)


def peft_state_dict(weights: dict[str, Any], adapter: str = "default") -> dict[str, Any]:
    """A PEFT model's adapter tensors by the names PEFT's ``adapter_model.safetensors`` uses (the adapter's name
    dropped: ``...q_proj.lora_A.weight``), from full weights named as in the PEFT model."""
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        match = _PART.search(f".{name}")
        if match is None or match.group(2) != adapter:
            continue
        out[name.replace(f".{match.group(1)}.{adapter}", f".{match.group(1)}", 1)] = tensor
    return out


def write_peft_adapters(weights: dict[str, Any], configs: dict[str, dict[str, Any]], out: Any) -> list[Any]:
    """Write one PEFT model's adapters in PEFT's own format, what ``PeftModel.from_pretrained(base, out)`` loads:
    ``out/adapter_model.safetensors`` (the adapter's tensors, PEFT's names) and ``out/adapter_config.json`` for the
    ``default`` adapter, ``out/<name>/`` for any other (as PEFT's ``save_pretrained`` lays them out).

    ``weights``: full tensors named as in the PEFT model; ``configs``: ``{adapter: config}`` as
    :func:`adapter_configs` keeps them. Returns the files written."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    written: list[Any] = []
    for adapter, config in configs.items():
        tensors = peft_state_dict(weights, adapter)
        if not tensors:
            raise ValueError(f"no tensors of the adapter {adapter!r} among the weights given")
        folder = Path(out) if adapter == "default" else Path(out) / adapter
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "adapter_model.safetensors",
                  metadata={"format": "pt"})  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        written += [folder / "adapter_model.safetensors", folder / "adapter_config.json"]
    return written
