"""How a step calls an unmodified Hugging Face decoder under pipeline parallel, and what it gets back.

:func:`bind_call` binds the step's ``self.model(input_ids=..., attention_mask=..., labels=...)`` to the model's
signature: the first stage's input, the keyword tensors every stage gets with its microbatch, the labels. On the
last stage :func:`microbatch_output` hands the step the model's output class for one microbatch, with the model's
own loss weighted so that the microbatches' mean is the whole batch's (and, for a mixture-of-experts model, its
load-balancing loss added as the model adds it). The stages themselves: :mod:`cuboid.pipeline.decoder`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cuboid.pipeline.decoder import DecoderSplitError

IGNORE_INDEX = -100  # transformers' label for "no loss here" (padding, prompts)
_HARMLESS = {"use_cache": (None, False, True), "return_dict": (None, True), "logits_to_keep": (0, None)}
_LOSS_ONLY = ("labels", "shift_labels")


@dataclass
class _CallPlan:
    """How the step calls the decoder (``self.model(input_ids=..., attention_mask=..., labels=...)``), bound to the
    outer model's signature: the first stage's input, the keyword tensors every stage gets with its microbatch,
    and the labels the loss needs."""

    first_input: torch.Tensor
    stage_kwargs: dict[str, torch.Tensor]
    labels: torch.Tensor | None

    def predicted_tokens(self) -> torch.Tensor | None:
        """transformers' ``num_items_in_batch`` for the whole batch: the tokens its causal-LM loss averages over
        (labels shifted by one, ``-100`` left out). A device tensor: nothing is read on the host."""
        if self.labels is None:
            return None
        return self.labels[..., 1:].ne(IGNORE_INDEX).sum()


def bind_call(owner: nn.Module, args: tuple, kwargs: dict, hook: str, owner_name: str) -> _CallPlan:
    """Bind how ``hook`` called the decoder to its forward's signature; refuse what a pipeline cannot split."""
    try:
        bound = inspect.signature(type(owner).forward).bind(owner, *args, **kwargs).arguments
    except TypeError as err:
        raise DecoderSplitError(
            f"{hook} calls self.{owner_name}(...) with arguments its forward does not take: {err}"
        ) from None
    bound.pop("self", None)
    bound.update(bound.pop("kwargs", {}) or {})
    ids = bound.pop("input_ids", None)
    if not isinstance(ids, torch.Tensor):
        raise DecoderSplitError(
            f"{hook} calls self.{owner_name}(...) without input_ids; under pipeline parallelism the first stage starts "
            "from token ids (inputs_embeds= is not supported)."
        )
    batch = ids.shape[0]
    labels = bound.pop("labels", None)
    stage_kwargs: dict[str, torch.Tensor] = {}
    for name, value in bound.items():
        if value is None or (name in _HARMLESS and not torch.is_tensor(value) and value in _HARMLESS[name]):
            continue
        if name in _LOSS_ONLY or not isinstance(value, torch.Tensor):
            raise DecoderSplitError(
                f"{hook} calls self.{owner_name}(..., {name}={value!r}): under pipeline parallelism a stage returns "
                f"only its hidden states or logits. Leave {name} out of the call."
            )
        if value.dim() == 0 or value.shape[0] != batch:
            raise DecoderSplitError(
                f"{hook} passes {name} of shape {tuple(value.shape)} to self.{owner_name}(...), which cannot be split "
                f"into microbatches with input_ids of batch size {batch}: every keyword tensor needs the batch as its "
                "first dimension."
            )
        stage_kwargs[name] = value
    if isinstance(labels, torch.Tensor):
        from transformers.loss.loss_utils import ForCausalLMLoss

        if getattr(owner, "loss_function", None) is not ForCausalLMLoss:
            raise DecoderSplitError(
                f"{type(owner).__name__}'s loss is not transformers' causal-LM loss (a token mean over labels != -100), "
                "which Cuboid weights per microbatch to give the whole batch's loss. Compute the loss in the step from "
                f"out.logits instead of passing labels to self.{owner_name}(...)."
            )
        return _CallPlan(ids, stage_kwargs, labels)
    return _CallPlan(ids, stage_kwargs, None)


def microbatch_output(
    owner: nn.Module, logits: torch.Tensor, args: tuple, kwargs: dict, predicted: torch.Tensor | None, microbatches: int
) -> Any:
    """What ``self.model(...)`` returns to the step on the last stage for one microbatch: the model's output class
    with its logits and, when labels were given, the model's own loss weighted so that the microbatches' mean is
    the loss of the whole batch (``num_items_in_batch``: the whole batch's predicted tokens). ``logits`` is the
    last stage's output: the logits, or ``(logits, aux_loss)`` for a model with a load-balancing loss, which is
    added as the model adds it (``router_aux_loss_coef`` x this microbatch's own)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    aux_loss = None
    if isinstance(logits, tuple):
        logits, aux_loss = logits[0], logits[1].reshape(())
    bound = inspect.signature(type(owner).forward).bind(owner, *args, **kwargs).arguments
    labels = bound.get("labels")
    loss = None
    if labels is not None:
        loss_fn = owner.loss_function
        vocab = owner.config.get_text_config().vocab_size  # (a composite model's: its language model's)
        loss = loss_fn(logits=logits, labels=labels, vocab_size=vocab, num_items_in_batch=predicted) * microbatches
        if aux_loss is not None:
            loss = loss + owner.router_aux_loss_coef * aux_loss
    if aux_loss is not None:
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits)
    return CausalLMOutputWithPast(loss=loss, logits=logits)
