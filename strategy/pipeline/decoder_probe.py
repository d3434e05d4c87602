"""The pieces of a decoder's cut that need no stage: the error, the keyed block list, a stage's config, and what the
base model's forward does around its blocks, found by running it once on a tiny input with its blocks replaced
(:func:`check_embeddings_pass_through`): a stage that starts or ends mid-stack must not do it again, or miss it."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
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


def stage_config(config: Any, indices: Sequence[int]) -> Any:
    """A copy of the model's config for a stage holding the blocks ``indices``: per-layer lists (``layer_types``,
    the full or sliding-window attention of each block, which a forward reads by the block's position in the
    stack) are cut to those blocks."""
    staged = copy.copy(config)
    types_ = getattr(config, "layer_types", None)
    if isinstance(types_, list | tuple) and len(types_) == getattr(config, "num_hidden_layers", -1):
        object.__setattr__(staged, "layer_types", [types_[i] for i in indices])
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


def check_embeddings_pass_through(base: nn.Module, attr: str, name: str) -> str | None:
    """Run the base model's own forward once on a tiny input, with one recording block and every other child a
    pass-through: the block must receive ``inputs_embeds`` itself, and the output must be what the block returned.
    (A forward that scales the embeddings, or transforms the last hidden state outside its modules, would do it
    again, or not at all, on a stage that starts or ends mid-stack.) Runs on CPU; the model may be on meta.

    A forward that only multiplies ``inputs_embeds`` by a number it keeps as an attribute (Granite's
    ``embedding_multiplier``) passes: that attribute's name is returned, and a later stage sets it to 1 (the first
    stage scales once, as the whole model does)."""
    seen = _probe_first_block(base, attr, name)
    if seen is None:
        return None
    embeds, got = seen
    ratio = (got / embeds).flatten()
    scales = [
        key
        for key, value in vars(base).items()
        if isinstance(value, float) and not key.startswith("_") and torch.allclose(ratio, torch.tensor(value))
    ]
    if len(scales) == 1:
        probe = shallow_module_copy(base)
        setattr(probe, scales[0], 1.0)
        again = _probe_first_block(probe, attr, name)
        if again is None or torch.equal(*again):  # with it at 1, the block gets inputs_embeds' values
            return scales[0]
    raise DecoderSplitError(
        f"{name}.forward does not hand inputs_embeds to its first block unchanged (it transforms the embeddings "
        "itself, beyond a multiplier kept as an attribute): a later pipeline stage would apply that again to the "
        "hidden states it receives. This family is not supported under pipeline_parallel yet."
    )


def _probe_first_block(base: nn.Module, attr: str, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(inputs_embeds, what the first block got) when the block got something else; None when it got them."""
    probe = shallow_module_copy(base)
    recorder = _Recorder()
    for child in list(probe._modules):
        probe._modules[child] = _PassThrough()
    probe._modules[attr] = KeyedModuleList([("0", recorder)])
    config = getattr(base, "config", None)
    if config is not None:
        probe.config = stage_config(config, [0])
    width = getattr(config, "hidden_size", 8)
    embeds = torch.rand(1, 4, width, generator=torch.Generator().manual_seed(0)) + 0.5  # no zeros: a scale shows
    try:
        out = probe(inputs_embeds=embeds, use_cache=False)
    except Exception as err:  # the model's forward needs something a stage does not have
        raise DecoderSplitError(
            f"{name}.forward failed when run from inputs_embeds with its blocks replaced ({type(err).__name__}: "
            f"{err}); Cuboid cannot run it as pipeline stages."
        ) from err
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None and isinstance(out, tuple | list):
        hidden = out[0]
    if len(recorder.seen) != 1:
        raise DecoderSplitError(
            f"{name}.forward does not run its first block once on inputs_embeds: Cuboid cannot run it as stages."
        )
    if recorder.seen[0] is not embeds:
        if recorder.seen[0].shape != embeds.shape:
            raise DecoderSplitError(
                f"{name}.forward does not hand inputs_embeds to its first block unchanged (it transforms the "
                "embeddings itself): a later pipeline stage would apply that again. This family is not supported "
                "under pipeline_parallel yet."
            )
        return embeds, recorder.seen[0]
    if hidden is not recorder.seen[0]:
        raise DecoderSplitError(
            f"{name}.forward changes the hidden states after its blocks outside its own modules: a stage that ends "
            "mid-stack would apply that too early. This family is not supported under pipeline_parallel yet."
        )
