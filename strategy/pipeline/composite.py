"""Pipeline stages of a composite model: a vision tower and a projector beside the language model whose blocks are cut.

The composite's own forward runs on the first stage: the tower, the projector and what it makes of their output,
then its language model with the first stage's blocks. What it hands its language model either takes the
image tokens' places in the language model's input (LLaVA: ``inputs_embeds``, already in the hidden states a
later stage receives), or is read by blocks on every stage: Mllama's ``cross_attention_states``, the image
states its cross-attention layers attend to. Those are the **carried** arguments (:func:`carried_names`),
found from the two forwards' signatures, not from a class name: the arguments both the composite's and its
language model's forwards take that are neither the text inputs every decoder takes (:data:`TEXT_INPUTS`) nor
given by the step's own call (Mllama's ``cross_attention_mask`` is the user's; its ``cross_attention_states`` is
the tower's when the call gives ``pixel_values``). The first stage sends each carried tensor beside its hidden
states, a middle stage passes them on, and a later stage runs the composite's forward again with them in place
of the images (its tower and projector stand in by shape only), so what the composite derives from the step's
own arguments (Mllama's additive cross-attention mask and its masked-out text rows) is rebuilt there by the
model's own code. The image states' gradient comes back through the sends: the tower's gradient is the sum of
every stage's cross-attention layers' share.

The composite's other parts must run before its language model (checked at each step on the first stage:
:func:`check_order`), whatever order they are registered in (Mllama registers its projector after).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from cuboid.pipeline.decoder_probe import DecoderSplitError

# What every decoder's forward takes, rebuilt or given on every stage: never carried between stages.
TEXT_INPUTS = frozenset(
    {"input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
     "cache_position", "kwargs", "return_dict", "output_attentions", "output_hidden_states", "logits_to_keep"}
)  # fmt: skip


def composite_args(composite: nn.Module, text: nn.Module) -> tuple[list[str], list[str]]:
    """``(first_only, carried)``: the composite forward's arguments its language model does not take (the images:
    the first stage's only), and those both take beyond :data:`TEXT_INPUTS` (candidates to carry, see
    :func:`carried_names`). Refuses, by name, a composite whose language model's inputs a later stage cannot
    rebuild."""
    name = type(composite).__name__
    own = list(inspect.signature(type(composite).forward).parameters)
    text_args = set(inspect.signature(type(text).forward).parameters)
    first_only = [n for n in own if n not in text_args]
    carried = [n for n in own if n in text_args and n not in TEXT_INPUTS and n != "self"]
    if callable(getattr(composite, "get_rope_index", None)):  # Qwen2-VL's family: positions from the images
        raise DecoderSplitError(
            f"{name} computes its language model's positions itself (multimodal rotary positions, from each "
            "image's grid), which its language model alone (a later stage) cannot rebuild. Not supported under "
            "pipeline_parallel yet; data, tensor and context parallel take it."
        )
    if "token_type_ids" in first_only:  # Gemma 3, PaliGemma: a mask built from them, in every layer
        raise DecoderSplitError(
            f"{name}.forward takes token_type_ids: its image tokens attend to each other both ways in every layer, "
            "through a mask it builds from them, which its language model alone (a later stage) cannot rebuild. "
            "Not supported under pipeline_parallel yet; data and tensor parallel take it."
        )
    return first_only, carried


def carried_names(candidates: tuple[str, ...], kwargs: dict[str, Any]) -> list[str]:
    """The carried arguments of this call: the candidates the step's call does not give itself (every stage gets
    the call's keyword tensors with its microbatch, so every stage reaches the same list)."""
    return [n for n in candidates if n not in kwargs]


@contextmanager
def handed_to(text: nn.Module, names: list[str], composite: nn.Module) -> Iterator[dict[str, Any]]:
    """Around the first stage's run of the composite's forward: the yielded dict receives what it hands its
    language model under ``names``; :func:`check_order` on the way out."""
    handed: dict[str, Any] = {}
    order: list[str] = []

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        order.append("")
        handed.update({n: kwargs.get(n) for n in names})

    handles = [text.register_forward_pre_hook(keep, with_kwargs=True)]
    for part, module in composite.named_children():
        if module is not text and any(True for _ in module.parameters()):
            handles.append(module.register_forward_pre_hook(lambda m, a, part=part: order.append(part)))
    try:
        yield handed
    finally:
        for handle in handles:
            handle.remove()
    check_order(composite, order)


def check_order(composite: nn.Module, order: list[str]) -> None:
    """Refuse a composite whose other parts ran after its language model began (``order``: the parts' names as
    they began, ``""`` for the language model): the first stage sends the language model's hidden states, so what
    ran after it would be lost."""
    after = [n for n in order[order.index("") + 1 :] if n] if "" in order else []
    if after:
        raise DecoderSplitError(
            f"{type(composite).__name__} runs {sorted(set(after))} after its language model; Cuboid runs a composite "
            "model's other parts on the first stage, before the blocks. Not supported under pipeline_parallel."
        )


def sent(handed: dict[str, Any], names: list[str], composite: nn.Module) -> list[torch.Tensor]:
    """The carried tensors the first stage sends, in ``names``' order; refuses a step without one (a batch
    without images: a later stage could not tell)."""
    missing = [n for n in names if not isinstance(handed.get(n), torch.Tensor)]
    if missing:
        raise DecoderSplitError(
            f"{type(composite).__name__} handed its language model no {missing} in this step (a batch without "
            "images?); under pipeline_parallel every step's later stages read them, so each step needs its images "
            f"(or pass {missing[0]}= in the call yourself)."
        )
    return [handed[n] for n in names]
