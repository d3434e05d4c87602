"""What context parallel cuts of a language model's inputs, and attention whose keys are not the sequence's.

A language model is handed, beside its tokens, tensors that run along its sequence and tensors that do not. The
first kind are cut with the tokens (this rank's positions, in the order its rows run): ``(batch, seq, ...)``
tensors along dim 1 (positions, per-token features), and masks laid out as attention masks, ``(batch, 1, seq,
keys)``, along dim 2, their query rows (Mllama's additive cross-attention mask and its masked-out text rows,
``(batch, 1, seq, 1)``). The second kind stay whole on every rank: anything that carries a gradient and is not
the tokens' own input (the image states a vision tower made, which cross-attention layers read as keys).

A **cross-attention** call (queries from this rank's tokens, keys and values from such whole states) needs no
other rank: each query row attends to every key, as in one process, under its own row of the mask, so it runs
as plain (non-causal) attention here. It is told from a self-attention call by its keys: not this rank's share
of the sequence (their number is not the local token count), or a mask whose key columns are those of a mask cut
here by its rows (:func:`is_cross_attention`).
"""

from __future__ import annotations

from typing import Any

import torch


def cut_along_sequence(
    name: str, value: Any, first: str | None, batch: int, seq_len: int, positions: torch.Tensor, cut_masks: set[int]
) -> torch.Tensor | None:
    """``value`` (the language model's argument ``name``) cut to this rank's ``positions``, or None when it does
    not run along the sequence. A mask cut by its rows leaves its key count in ``cut_masks``."""
    if name == "labels" or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    if value.requires_grad and name != first:  # states made from parameters (a tower's): keys, whole everywhere
        return None
    if tuple(value.shape[:2]) == (batch, seq_len):
        return value.index_select(1, positions)
    if value.dim() == 4 and value.shape[0] == batch and value.shape[1] == 1 and value.shape[2] == seq_len:
        cut_masks.add(value.shape[-1])
        return value.index_select(2, positions)
    return None


def is_cross_attention(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, local: int, cut_masks: set[int]
) -> bool:
    """Whether an attention call under context parallel attends over whole states rather than the split sequence:
    its keys are not the ``local`` tokens of this rank, or it is handed a mask with this rank's query rows and
    the key columns of a mask cut by its rows."""
    if key.shape[-2] != local:
        return True
    rows = mask is not None and mask.dim() == 4 and mask.shape[-2] == query.shape[-2]
    return bool(rows and mask.shape[-1] == key.shape[-2] and mask.shape[-1] in cut_masks)
