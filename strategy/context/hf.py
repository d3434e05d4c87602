"""Context parallel for transformers models, through transformers' own attention-function registry.

Cuboid registers ``"cuboid_cp"`` in ``AttentionInterface`` (an attention function) and switches a model to it
with ``set_attn_implementation``: no edit to the model's code. transformers builds no mask for an
implementation its mask registry does not list; the function applies the causal mask on global positions, a
sliding-window layer's window (``sliding_window``, as transformers passes it to the attention function), attention
sinks (``s_aux``), soft-capped scores (``softcap``) and the padding of the whole batch's ``attention_mask``
itself. Outside a context-parallel step it is the ``sdpa`` function, with no mask (plain causal attention). What
else changes the attention (``UNCOMPUTED``) is refused at the first forward, by name, and so is a mask a layer makes
itself (one that carries a gradient or differs by head: Doge's dynamic mask); transformers' own causal and padding
masks are ignored, since this function applies both on global positions.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from cuboid.context.attention import ContextParallelError
from cuboid.context.cross import is_cross_attention
from cuboid.context.current import KEY_PADDING, active

NAME = "cuboid_cp"
# What some families pass their attention function that changes its result and that "cuboid_cp" does not compute:
# T5-style relative position biases, sparse attention's selected keys, another name for sinks, head masks, ALiBi.
UNCOMPUTED = ("position_bias", "indices", "block_indices", "sinks", "head_mask", "alibi_slopes")
# Layer types (transformers' ``config.layer_types``) whose layers mix tokens only through softmax attention, or not at
# all: what context parallel splits exactly. Any other (linear attention, state-space, convolution, hybrid layers)
# mixes tokens along the sequence outside attention, where a rank would see its own tokens only.
SPLIT_LAYER_TYPES = {"full_attention", "sliding_attention", "mlp", "moe"}
# Implementations whose result is plain softmax attention, which "cuboid_cp" computes exactly.
EXACT = {"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4"}


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cp = active()
    padding = kwargs.pop(KEY_PADDING, None)
    if cp is None:  # the model run outside a context-parallel step (predict, a user's own call): plain sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    layer = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    unknown = sorted(name for name in UNCOMPUTED if kwargs.get(name) is not None)
    if unknown:
        raise ContextParallelError(
            f"context_parallel={cp.size}: {layer} passes {', '.join(unknown)} to its attention function, which "
            "changes the attention Cuboid's context-parallel attention computes (it computes causal softmax "
            "attention with padding, sliding windows, sinks and soft-capping). Use context_parallel=1."
        )
    if cp._seq is not None and is_cross_attention(query, key, attention_mask, cp._seq[1] // cp.size, cp.cut_masks):
        # keys over whole states (the image's), queries this rank's tokens, the mask cut by its rows: plain attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, False, **kwargs)
    per_head = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] > 1
    if per_head or (attention_mask is not None and attention_mask.requires_grad):
        # a mask the layer made itself (learned, or per head). transformers' own causal/padding masks (no gradient,
        # one head) come only from a config left at another implementation, and are applied here on global positions
        raise ContextParallelError(
            f"context_parallel={cp.size}: {layer} passes its attention function a mask of its own making (shape "
            f"{tuple(attention_mask.shape)}, e.g. Doge's dynamic mask, computed from this rank's tokens), which "
            "Cuboid's context-parallel attention cannot extend to the other ranks' keys (it computes causal softmax "
            "attention with padding, sliding windows, sinks and soft-capping). Use context_parallel=1."
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    gqa, dropout = key.shape[1] != query.shape[1], dropout if module.training else 0.0
    window = kwargs.get("sliding_window")  # the layer's own (None on a model's global layers)
    sink = kwargs.get("s_aux")  # attention sinks: a logit per head that joins the softmax (GPT-OSS's ``sinks``)
    softcap = kwargs.get("softcap")  # Gemma 2's soft-capped scores
    out = cp.attention(query, key, value, bool(causal), scaling, gqa, dropout, padding, window, sink, softcap)
    return out.transpose(1, 2).contiguous(), None


def use_cp_attention(model: nn.Module) -> bool:
    """Switch a transformers model to ``"cuboid_cp"`` (True); a plain model is left alone (False)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return False
    from transformers import AttentionInterface

    _check_layer_types(model, config)
    current = getattr(config, "_attn_implementation", None) or "sdpa"
    if current not in EXACT | {NAME}:
        raise ContextParallelError(
            f"context_parallel cannot split attn_implementation={current!r} of {type(model).__name__}: Cuboid's "
            f"context-parallel attention computes plain causal softmax attention ({', '.join(sorted(EXACT))} "
            "compute the same). Load the model with attn_implementation='sdpa', or use context_parallel=1."
        )
    AttentionInterface.register(NAME, _attention)
    model.set_attn_implementation(NAME)
    return True


def _check_layer_types(model: nn.Module, config: Any) -> None:
    """Refuse a model with layers that mix tokens outside attention (see ``SPLIT_LAYER_TYPES``), by type and index."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None) or getattr(config, "layer_types", None) or []
    other: dict[str, list[int]] = {}
    for index, kind in enumerate(types):
        if kind not in SPLIT_LAYER_TYPES:
            other.setdefault(str(kind), []).append(index)
    if other:
        named = "; ".join(f"{kind!r} (layers {', '.join(map(str, idx[:6]))}{', ...' if len(idx) > 6 else ''})"
                          for kind, idx in other.items())  # fmt: skip
        raise ContextParallelError(
            f"context_parallel cannot split {type(model).__name__}: config.layer_types has {named}, layers that mix "
            "tokens along the sequence outside softmax attention (linear attention, state-space or convolution "
            "layers). Cuboid's context parallel splits attention across ranks only, so those layers would see this "
            "rank's tokens alone and train silently wrong. Use context_parallel=1."
        )


def language_model(root: nn.Module, lm: nn.Module, blocks: list[str], pipelined: bool) -> nn.Module:
    """Where the sequence is cut: ``root``, or in a composite model (a transformers vision-language model: a vision
    tower and a projector whose features take the image tokens' places in its language model's input), its
    language model, which holds the blocks. The tower then runs on whole images on every rank, and only the
    language model's own sequence (``inputs_embeds``, the image features merged) is cut, image tokens at their
    global positions."""
    config = getattr(root, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config:
        return root
    name = type(root).__name__.removeprefix("FSDP")  # (FSDP2's class for a sharded module)
    if "token_type_ids" in inspect.signature(type(root).forward).parameters:
        raise ContextParallelError(
            f"context_parallel cannot split {name}: its image tokens attend to each other both ways, through a "
            "mask its forward builds from token_type_ids, and Cuboid's context-parallel attention is causal "
            "(with windows). Use context_parallel=1; data and tensor parallel take it."
        )
    if pipelined:
        raise ContextParallelError(
            f"context_parallel with pipeline_parallel cannot split {name} yet: the first stage's token ids would be "
            "cut before its image features take their places. Use one of the two."
        )
    holder = blocks[0].rsplit(".", 2)[0]  # "model.model.language_model" of "model.model.language_model.layers.0"
    try:
        return lm.get_submodule(holder)
    except AttributeError:
        return root.get_submodule(holder.partition(".")[2])
