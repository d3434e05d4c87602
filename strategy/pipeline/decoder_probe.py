"""The pieces of a decoder's cut that need no stage: the error, the keyed block list, a stage's config, and what the
base model's forward must do for a later stage to run it (:func:`check_stage_forward`, which runs it once on a tiny
input with its blocks replaced), and the stand-in for what that forward runs before its blocks (:class:`ShapeOnly`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn

from cuboid.compat import shallow_module_copy


class DecoderSplitError(ValueError):
    """Raised (as the pipeline's own PipelineError) when a model is not of the decoder shape."""


class KeyedModuleList(nn.ModuleList):
    """A ``ModuleList`` that keeps its children's original keys (``"4"``, ``"5"``, ...), so a stage holding blocks 4
    to 7 names their parameters ``layers.4...`` as the whole model does. Iteration, ``len`` and slicing (what a
    decoder's forward uses: ``self.layers[: n]``) go by position."""

    def __init__(self, items: Sequence[tuple[str, nn.Module]] = ()) -> None:
        super().__init__()
        for key, module in items:
            self.add_module(key, module)

    def __getitem__(self, idx: int | slice) -> Any:
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(values[idx])
        return values[idx]

    def keyed_items(self) -> list[tuple[str, nn.Module]]:
        return list(self._modules.items())


def stage_config(config: Any, indices: Sequence[int], numbers: dict[str, list[int]] | None = None) -> Any:
    """A copy of the model's config for a stage holding the blocks ``indices``: per-layer lists (``layer_types``,
    the full or sliding-window attention of each block, which a forward reads by the block's position in the
    stack) are cut to those blocks; ``numbers``: lists of layer numbers as the stage numbers them
    (:func:`stage_layer_numbers`)."""
    staged = copy.copy(config)
    for name, staged_numbers in (numbers or {}).items():
        object.__setattr__(staged, name, staged_numbers)
    types_ = getattr(config, "layer_types", None)
    if isinstance(types_, list | tuple) and len(types_) == getattr(config, "num_hidden_layers", -1):
        object.__setattr__(staged, "layer_types", [types_[i] for i in indices])
    return staged


def stage_layer_numbers(module: nn.Module, config: Any, indices: Sequence[int]) -> dict[str, list[int]]:
    """Lists of layer numbers the base model keeps as its own attributes, taken from its config (Mllama's
    ``cross_attention_layers``, which its forward compares with each block's position in the stack), as a stage
    holding the blocks ``indices`` numbers them: the stage's positions of the layers it holds."""
    layers = getattr(config, "num_hidden_layers", -1)
    staged: dict[str, list[int]] = {}
    for name, value in vars(module).items():
        if name.startswith("_") or value is not getattr(config, name, None) or not isinstance(value, list):
            continue
        if value and len(value) < layers and all(type(v) is int and 0 <= v < layers for v in value):
            staged[name] = [list(indices).index(v) for v in value if v in indices]
    return staged


class _Recorder(nn.Module):
    """A stand-in block: records the hidden states it is given and returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.seen.append(hidden_states)
        return hidden_states


class _PassThrough(nn.Module):
    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer an empty tensor on the meta device (its own tensors untouched)."""
    clone = copy.copy(module)
    clone._parameters = {
        n: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        for n, p in module._parameters.items()
    }
    clone._buffers = {n: None if b is None else torch.empty_like(b, device="meta") for n, b in module._buffers.items()}
    clone._modules = {n: None if c is None else _meta_copy(c) for n, c in module._modules.items()}
    clone._forward_hooks, clone._forward_pre_hooks = type(clone._forward_hooks)(), type(clone._forward_pre_hooks)()
    return clone


class ShapeOnly:
    """Stands in, on a later pipeline stage, for a piece its base model's forward runs before the blocks (GPT-2's
    learned positions ``wpe``): it holds no parameters and returns zeros of the shape and dtype the piece would.
    What the forward then makes of them never reaches a block: the stage hands its first block the hidden states it
    received (:func:`cuboid.pipeline.decoder.stage_edges`). Not a module: it is set as a plain attribute in place of
    the piece (:func:`stand_in`), so no walk over modules (plans, FSDP, state dicts) meets it."""

    def __init__(self, module: nn.Module) -> None:
        self._meta = _meta_copy(module)

    def __getattr__(self, name: str) -> Any:  # what a forward reads of the piece (Mllama's vision_model.num_patches)
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["_meta"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")

        def meta(value: Any) -> Any:
            return value.to("meta") if isinstance(value, torch.Tensor) else value

        out = self.__dict__["_meta"](*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})
        return apply_to_collection(out, torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device))


def stand_in(parent: nn.Module, name: str, module: nn.Module) -> None:
    """Put a :class:`ShapeOnly` for ``parent``'s child ``name`` (``module``) in its place, as a plain attribute."""
    parent._modules.pop(name, None)
    parent.__dict__[name] = ShapeOnly(module)


def check_stage_forward(base: nn.Module, attr: str, name: str, pre: Sequence[str] = ()) -> None:
    """Run the base model's own forward once on a tiny input, as a later stage runs it: one recording block, the
    pieces ``pre`` (its children run before the blocks) standing in as :class:`ShapeOnly`, every other child a
    pass-through. The forward must run its first block once, on hidden states of ``inputs_embeds``' shape, by
    position or as ``hidden_states=``: whatever it does to them before (Granite's multiplier, GPT-2's positions)
    runs on the first stage only, since a later stage hands its first block the hidden states it received. Runs on
    CPU; the model may be on meta."""
    probe = shallow_module_copy(base)
    recorder = _Recorder()
    for child in list(probe._modules):
        module = probe._modules[child]
        if child in pre and module is not None:
            stand_in(probe, child, module)
        else:
            probe._modules[child] = _PassThrough()
    probe._modules[attr] = KeyedModuleList([("0", recorder)])
    config = getattr(base, "config", None)
    if config is not None:
        probe.config = stage_config(config, [0])
    width = getattr(config, "hidden_size", 8)
    embeds = torch.rand(1, 4, width, generator=torch.Generator().manual_seed(0)) + 0.5
    try:
        probe(inputs_embeds=embeds, use_cache=False)
    except Exception as err:  # the model's forward needs something a stage does not have
        raise DecoderSplitError(
            f"{name}.forward failed when run from inputs_embeds with its blocks replaced ({type(err).__name__}: "
            f"{err}); Cuboid cannot run it as pipeline stages."
        ) from err
    if len(recorder.seen) != 1:
        raise DecoderSplitError(
            f"{name}.forward does not run its first block once on inputs_embeds: Cuboid cannot run it as stages."
        )
    if recorder.seen[0].shape != embeds.shape:
        raise DecoderSplitError(
            f"{name}.forward hands its first block hidden states of shape {tuple(recorder.seen[0].shape)} from "
            f"inputs_embeds of shape {tuple(embeds.shape)}: a later pipeline stage, which receives the hidden states "
            "between two blocks, cannot stand for that. Cuboid cannot run it as pipeline stages."
        )
