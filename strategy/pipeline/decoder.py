"""Pipeline stages of an unmodified Hugging Face decoder (``AutoModelForCausalLM`` and models of its shape).

Such a model runs ``embeddings -> a stack of blocks -> a final norm`` in its base model (``model.model``) and a
head in its outer model (``model.lm_head``), computing once at the top what every block needs: the causal (or
sliding-window) mask from ``attention_mask``, the position ids and the rotary embeddings. A stage keeps the
model's own modules under their own names and runs the model's own code:

* every stage calls the base model's own ``forward`` with only its blocks in the stack: the first stage on the
  token ids, a later one on the hidden states it receives (``inputs_embeds=``, which skips the embedding). So each
  stage recomputes the mask, positions and rotary embeddings exactly as the model does, from the
  ``attention_mask`` / ``position_ids`` that every stage gets with its microbatch;
* what the forward does between its embeddings and its first block (Granite's multiplier, GPT-2's learned
  positions and dropout) runs once, on the first stage: a later stage's first block is handed the hidden states
  received (:func:`stage_edges`), and the pieces with parameters it would run there stand in by shape only;
* a stage that is not the last has an identity in place of the final norm and returns what its last block
  returned: what the forward does after its blocks (GPT-2's reshape) runs on the last stage only;
* the last stage then runs the outer model's own ``forward`` with its base model standing in as "the hidden
  states just computed": the head, logit scaling or soft-capping are the model's own. It outputs the logits.

The loss is the model's own loss function, on the last stage, per microbatch, with transformers'
``num_items_in_batch`` set to the whole batch's count of predicted tokens: the sum over microbatches is the loss
(and the gradient) of one big batch, ``-100`` labels and padding included.

A mixture-of-experts model whose loss adds the load-balancing loss (``config.output_router_logits``) needs every
layer's router statistics at once (:mod:`cuboid.experts.balance`). Each stage sends the parts it has so far (per
expert choice counts and probability sums, and the rows: ``2E + 1`` numbers, its own layers' added to those it
received) beside its hidden states; the last stage sums them over the ranks holding the step's other tokens and
outputs the loss beside the logits. The backward reaches every stage's routers through those sends. The loss is
each microbatch's own: its gradient is needed before the later microbatches have run forward.

Which models qualify (checked when the stages are built, each failure named): the blocks sit in a
``ModuleList`` of the base model, whose ``forward`` takes ``inputs_embeds`` and runs its first block once on
hidden states of their shape; the outer model calls the base model and reads ``last_hidden_state``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cuboid.compat import shallow_module_copy
from cuboid.context import KEY_PADDING
from cuboid.context import active as context_active
from cuboid.experts import (
    active_balancing,
    balancing_loss,
    balancing_statistics,
    check_router_loss_model,
    router_loss_model,
)
from cuboid.pipeline.composite import carried_names, composite_args, handed_to, sent
from cuboid.pipeline.decoder_probe import (
    DecoderSplitError,
    KeyedModuleList,
    check_stage_forward,
    stage_config,
    stage_layer_numbers,
    stand_in,
)


@dataclass
class DecoderShape:
    """Where a decoder is cut, by dotted names relative to the outer model (the LightningModule's attribute). In a
    composite model (a vision-language one) the base model holds a vision tower, a projector and the language model
    whose blocks are cut: ``text`` is that language model; in a decoder it is the base model itself."""

    base: str  # the base model ("model"); "" when the attribute is the base model itself
    container: str  # the blocks ("model.layers", "model.language_model.layers")
    pre: list[str] = field(default_factory=list)  # pieces before the blocks, on the first stage ("model.embed_tokens")
    post: list[str] = field(default_factory=list)  # after them, on the last stage ("model.norm", "lm_head")
    router_loss: bool = False  # the loss adds a load-balancing loss: its statistic travels with the hidden states
    text: str = ""  # the model holding the blocks ("model.language_model"); the base model when it is ""
    first_only: list[str] = field(default_factory=list)  # the call's arguments only the first stage takes (images)
    carried: list[str] = field(default_factory=list)  # what may travel beside the hidden states (pipeline.composite)


def _child_order(module: nn.Module, plan: dict[str, Any] | None) -> list[str]:
    """The children in the order the model runs them: its own pipeline plan's order where it declares one
    (transformers' ``base_model_pp_plan`` / ``_pp_plan``), else their registration order."""
    names = list(module._modules)
    if plan:
        declared = [n for n in plan if n in module._modules]
        return declared + [n for n in names if n not in declared]
    return names


def _has_params(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def find_decoder_shape(owner: nn.Module, owner_name: str, container: str) -> DecoderShape:
    """Check that ``owner`` (the LightningModule's ``owner_name``) is a decoder whose blocks are ``container``; say
    what is missing when it is not."""
    text_path, _, attr = container.rpartition(".")
    base_path, _, text_attr = text_path.rpartition(".")
    if "." in base_path:
        raise DecoderSplitError(
            f"{owner_name}.{container} lies {container.count('.')} levels deep; a decoder's blocks sit in its base "
            f"model (e.g. {owner_name}.model.layers), a composite model's in the language model beside its vision "
            f"tower (e.g. {owner_name}.model.language_model.layers)."
        )
    if not base_path:  # a decoder: the blocks' model is the base model
        base_path, text_attr = text_path, ""
    composite = owner.get_submodule(base_path) if base_path and text_attr else None
    base = owner.get_submodule(text_path) if text_path else owner
    blocks = getattr(base, attr)
    if not isinstance(blocks, nn.ModuleList):
        raise DecoderSplitError(
            f"{owner_name}.{container} is an nn.{type(blocks).__name__}; a decoder's blocks must be an nn.ModuleList "
            "that its forward iterates."
        )
    if "inputs_embeds" not in inspect.signature(type(base).forward).parameters:
        raise DecoderSplitError(
            f"{type(base).__name__}.forward takes no inputs_embeds: a later pipeline stage could not hand it the hidden "
            "states it receives. Pipeline parallel runs a decoder whose base model takes inputs_embeds (every "
            "transformers decoder does), or a model written for Cuboid's pipeline contract (docs/pipeline.md)."
        )
    config = getattr(base, "config", None)
    router_loss = router_loss_model(owner)
    if router_loss:
        try:
            check_router_loss_model(owner)
        except ValueError as err:
            raise DecoderSplitError(str(err)) from None
    base_order = _child_order(base, getattr(config, "base_model_pp_plan", None))
    at = base_order.index(attr)
    prefix = f"{text_path}." if text_path else ""
    own_pre = [n for n in base_order[:at] if _has_params(base._modules[n])]
    pre = [prefix + n for n in own_pre]
    post = [prefix + n for n in base_order[at + 1 :] if _has_params(base._modules[n])]
    if base_path:
        owner_order = _child_order(owner, getattr(type(owner), "_pp_plan", None))
        before = [n for n in list(owner._modules)[: list(owner._modules).index(base_path)] if n != base_path]
        if any(_has_params(owner._modules[n]) for n in before):
            raise DecoderSplitError(
                f"{type(owner).__name__} has modules with parameters registered before its base model "
                f"({[n for n in before if _has_params(owner._modules[n])]}); Cuboid runs an outer model's own pieces "
                "after the blocks only (a head)."
            )
        post += [n for n in owner_order if n != base_path and _has_params(owner._modules[n])]
    first_only: list[str] = []
    carried: list[str] = []
    if composite is not None:  # its other parts (vision tower, projector) run on the first stage, before the text's
        parts = [n for n in composite._modules if n != text_attr and _has_params(composite._modules[n])]
        pre = [f"{base_path}.{n}" for n in parts] + pre
        first_only, carried = composite_args(composite, base)
        if carried and router_loss:
            raise DecoderSplitError(
                f"{type(composite).__name__} hands its language model {carried} and adds a load-balancing loss: "
                "Cuboid's stages carry one of the two. Not supported under pipeline_parallel yet."
            )
    check_stage_forward(base, attr, type(base).__name__, own_pre)
    text = text_path if composite else ""
    return DecoderShape(base_path, container, pre, post, router_loss, text, first_only, carried)


@dataclass
class _StageInfo:
    base: str
    first: bool
    last: bool
    router_loss: bool = False
    text: str = ""  # a composite model's language model (later stages run it alone)
    first_only: tuple[str, ...] = ()
    blocks: str = ""  # the attribute of the base (or language) model holding the blocks
    carried: tuple[str, ...] = ()  # a composite's arguments that may travel beside the hidden states


class _FixedOutput(nn.Module):
    """Stands in for the base model inside the outer model's forward: returns what the stage's base model already
    returned (its own output type: an MoE model's carries ``router_logits``, which its outer forward reads)."""

    def __init__(self, output: Any, composite: bool = False) -> None:
        super().__init__()
        self.output, self.composite = output, composite

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.composite:  # the language model's output, read as the composite model's (its image outputs: None)
            return _Outputs(self.output)
        if hasattr(self.output, "last_hidden_state"):
            return self.output
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.output[0])


class _Outputs:
    """A composite model's output as its outer forward reads it: ``[0]`` and ``last_hidden_state`` are the language
    model's hidden states; what only the composite model returns (its image outputs) is None on a later stage."""

    def __init__(self, output: Any) -> None:
        self.output = output

    def __getitem__(self, index: int) -> Any:
        return self.output[index]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.output, name, None)


@contextmanager
def _base_replaced(stage: nn.Module, base: str, output: Any, composite: bool = False) -> Iterator[None]:
    real = stage._modules[base]
    stage._modules[base] = _FixedOutput(output, composite)
    try:
        yield
    finally:
        stage._modules[base] = real


def _stage_forward(self: nn.Module, x: torch.Tensor, *received: torch.Tensor, **kwargs: Any) -> Any:
    """A decoder stage's forward (bound to the stage, a view of the outer model; see the module docstring).
    ``received``: the load-balancing statistic's parts the stage before sent (a model with a load-balancing loss,
    not the first stage). Returns the hidden states, or the last stage's logits; with a load-balancing loss, the
    parts so far beside the hidden states, and the microbatch's loss beside the logits."""
    info: _StageInfo = self.__dict__["_cuboid_stage"]
    base = self.get_submodule(info.base) if info.base else self
    text = self.get_submodule(info.text) if info.text else base  # the model holding the blocks
    carried = carried_names(info.carried, kwargs) if info.text else []
    inputs = {"input_ids" if info.first else "inputs_embeds": x}
    if info.text and not info.first:  # a composite's later stage: no images; the language model alone, or the
        kwargs = {k: v for k, v in kwargs.items() if k not in info.first_only}  # composite on what was carried
        inputs.update(zip(carried, received[: len(carried)], strict=True))
        received = received[len(carried) :]
        base = base if carried else text
    blocks = getattr(text, info.blocks)
    with (
        stage_edges(blocks, None if info.first else x, capture=not info.last) as edges,
        handed_to(text, carried, base) if info.first and info.text else nullcontext({}) as handed,
    ):
        out = (
            type(base).forward(base, **inputs, use_cache=False, **kwargs)
            if base is self
            else base(**inputs, use_cache=False, **kwargs)
        )
    hidden = edges[0] if edges else (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])
    if carried and not info.last:  # the image states, on to the next stage (a middle stage's as received)
        onward = sent(handed, carried, base) if info.first else [inputs[n].view_as(inputs[n]) for n in carried]
        return (hidden, *onward)
    parts = _balance_parts(self, received, out, kwargs) if info.router_loss else None
    if not info.last or not info.base:
        return hidden if parts is None else (hidden, parts)
    mask = {"attention_mask": kwargs["attention_mask"]} if "attention_mask" in kwargs else {}
    with _base_replaced(self, info.base, out, composite=bool(info.text)):
        result = type(self).forward(self, use_cache=False, **mask)
    if parts is None:
        return result.logits
    experts = self.num_experts
    lb = active_balancing()
    if lb is not None and not lb.checked and out.router_logits:  # the model's own aux_loss (its layers') = ours
        own = balancing_statistics(out.router_logits, experts, self.num_experts_per_tok, mask.get("attention_mask"))
        lb.check(self, result.aux_loss, balancing_loss(own, experts))
    whole = lb.whole(parts) if lb is not None else parts
    # (the loss with a dimension: the schedule concatenates each output over the microbatches)
    return result.logits, balancing_loss(whole, experts).reshape(1)


@contextmanager
def stage_edges(blocks: nn.ModuleList, received: torch.Tensor | None, capture: bool) -> Iterator[list[torch.Tensor]]:
    """Around a stage's run of its base model's forward: hand the first block ``received`` (the hidden states the
    stage before sent; whatever the forward did to them before its blocks ran on the first stage already), and with
    ``capture``, keep what the last block returned (yielded list): what the forward does after its blocks (a final
    norm, a reshape) runs on the last stage only. Nothing is changed when ``received`` is None and not ``capture``."""
    handles = []
    edges: list[torch.Tensor] = []
    if received is not None:

        def hand(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (received, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": received}

        # (first among its hooks: FSDP's own pre-forward, which casts its inputs, sees the received states)
        handles.append(blocks[0].register_forward_pre_hook(hand, with_kwargs=True, prepend=True))
    if capture:

        def keep(module: nn.Module, args: tuple, output: Any) -> None:
            edges.append(output[0] if isinstance(output, tuple | list) else output)

        handles.append(blocks[-1].register_forward_hook(keep))
    try:
        yield edges
    finally:
        for handle in handles:
            handle.remove()


def _balance_parts(stage: nn.Module, received: tuple[torch.Tensor, ...], out: Any, kwargs: dict) -> torch.Tensor:
    """The load-balancing statistic's parts of every layer up to this stage's last: those received, plus this
    stage's own layers' (this rank's rows: under cp, its share of the padding mask)."""
    cp = context_active()
    padding = kwargs.get(KEY_PADDING) if cp is not None else kwargs.get("attention_mask")
    if cp is not None and padding is not None:
        padding = cp.local_padding(padding)
    routers = tuple(getattr(out, "router_logits", None) or ())
    own = balancing_statistics(routers, stage.num_experts, stage.num_experts_per_tok, padding)
    return own + received[0] if received else own


def _set_path(root: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, value)


def build_stage(
    owner: nn.Module, shape: DecoderShape, keys: Sequence[str], all_keys: Sequence[str], first: bool, last: bool
) -> nn.Module:
    """A view of ``owner`` that runs as one pipeline stage holding the blocks ``keys`` (the first / last stage's also
    their pieces), sharing every module with ``owner``."""
    stage = shallow_module_copy(owner)
    base = stage
    if shape.base:
        base = shallow_module_copy(owner.get_submodule(shape.base))
        stage._modules[shape.base] = base
    if shape.text:  # a composite model: its language model copied too, the blocks cut there
        text_attr = shape.text.rpartition(".")[2]
        base._modules[text_attr] = shallow_module_copy(base._modules[text_attr])
        base = base._modules[text_attr]
    attr = shape.container.rpartition(".")[2]
    by_key = getattr(base, attr)._modules  # keyed as in the whole model (a ModuleList's "0", "1", ...)
    base._modules[attr] = KeyedModuleList([(k, by_key[k]) for k in keys])
    if getattr(base, "config", None) is not None:
        indices = [list(all_keys).index(k) for k in keys]
        numbers = stage_layer_numbers(base, base.config, indices)
        base.config = stage_config(base.config, indices, numbers)
        base.__dict__.update(numbers)
    if not first:  # the language model's own pieces stand in by shape (its forward may run them: GPT-2's positions)
        text_prefix = f"{shape.text or shape.base}." if shape.text or shape.base else ""
        for path in shape.pre:
            in_composite = shape.text and shape.carried and path.rpartition(".")[0] == shape.base
            if in_composite or (path.startswith(text_prefix) and "." not in path[len(text_prefix) :]):
                parent, _, name = path.rpartition(".")
                stand_in(stage.get_submodule(parent) if parent else stage, name, owner.get_submodule(path))
            else:
                _set_path(stage, path, None)
    if not last:
        for path in shape.post:
            in_base = shape.base and path.startswith(f"{shape.base}.")
            _set_path(stage, path, nn.Identity() if in_base or not shape.base else None)
    stage.__dict__["_cuboid_stage"] = _StageInfo(
        shape.base, first, last, shape.router_loss, shape.text, tuple(shape.first_only), attr, tuple(shape.carried)
    )
    stage.forward = types.MethodType(_stage_forward, stage)
    return stage


def prune(owner: nn.Module, shape: DecoderShape, owned: Sequence[str], first: bool, last: bool) -> None:
    """Keep only this rank's blocks and pieces in ``owner`` itself (what the LightningModule's parameters, state dict
    and checkpoints see), under the whole model's names."""
    base = owner.get_submodule(shape.text or shape.base) if shape.text or shape.base else owner
    attr = shape.container.rpartition(".")[2]
    keep = set(owned)
    base._modules[attr] = KeyedModuleList([(k, m) for k, m in getattr(base, attr)._modules.items() if k in keep])
    if not first:
        for path in shape.pre:
            _set_path(owner, path, None)
    if not last:
        for path in shape.post:
            _set_path(owner, path, None)
