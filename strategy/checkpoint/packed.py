"""Packed experts from files that keep them one by one.

transformers 5 keeps a mixture-of-experts layer's experts packed in memory (``mlp.experts.gate_up_proj``:
experts x 2·intermediate x hidden, ``mlp.experts.down_proj``: experts x hidden x intermediate) but saves them,
as the Hub's checkpoints hold them, one expert at a time: ``mlp.experts.{e}.gate_proj.weight``, ``up_proj``,
``down_proj`` (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek and the rest of that family), or Mixtral's
``block_sparse_moe.experts.{e}.w1.weight`` (gate), ``w3`` (up), ``w2`` (down). Its loader merges them
(``conversion_mapping``: MergeModulelist on dim 0, then Concatenate gate and up on dim 1).

:func:`per_expert_keys` finds the file's keys for a packed parameter, and :class:`PackedExperts` stands for the
packed tensor without building it: asked for a region (what one rank's shard needs), it reads only the experts in
that region, so each rank of an expert-parallel layout touches only its own experts' pages of the file.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

__all__ = ["PackedExperts", "per_expert_keys", "saved_name"]

# transformers' renamings between a model's names and its saved ones (conversion_mapping's WeightRenaming)
RENAMED = ((".mlp.", ".block_sparse_moe."),)  # Mixtral (and MiniMax) save their MoE block under this name

# packed parameter -> the per-expert tensors it is made of, in order along its dim 1, by naming convention
PARTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}


def saved_name(key: str, available: Collection[str]) -> str | None:
    """The name ``key`` is saved under in ``available`` after transformers' renamings (Mixtral's
    ``block_sparse_moe`` for ``mlp``), if any."""
    for model_name, file_name in RENAMED:
        other = key.replace(model_name, file_name, 1)
        if other != key and other in available:
            return other
    return None


def per_expert_keys(key: str, num_experts: int, available: Collection[str]) -> list[list[str]] | None:
    """For the packed parameter ``key`` (``...experts.gate_up_proj`` or ``...experts.down_proj``), the ``available``
    keys that hold it one expert at a time: one list per expert, in the order they are concatenated. ``None``
    when the file does not keep it that way."""
    head, _, leaf = key.rpartition(".")
    if leaf not in PARTS or not head.endswith(".experts"):
        return None
    heads = [head, *(head.replace(m, f, 1) for m, f in RENAMED if m in head)]
    for where in heads:
        for names in PARTS[leaf]:
            keys = [[f"{where}.{e}.{name}.weight" for name in names] for e in range(num_experts)]
            if all(k in available for ks in keys for k in ks):
                return keys
    return None


class PackedExperts:
    """The packed tensor ``stack([cat(parts of expert e, dim=0) for e])`` over per-expert tensors (usually views
    of memory-mapped files), built region by region: :meth:`region` reads only the experts it covers."""

    def __init__(self, parts: Sequence[Sequence[torch.Tensor]]) -> None:
        self.parts = [list(p) for p in parts]
        first = self.parts[0]
        rows = sum(t.shape[0] for t in first)
        self.shape = torch.Size([len(self.parts), rows, *first[0].shape[1:]])
        self.dtype = first[0].dtype

    def size(self) -> torch.Size:
        return self.shape

    def dim(self) -> int:
        return len(self.shape)

    def region(self, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """``packed[o0:o0+l0, o1:o1+l1, ...]``, reading the experts ``[o0, o0 + l0)`` only."""
        experts = []
        for e in range(offsets[0], offsets[0] + lengths[0]):
            one = torch.cat(self.parts[e], dim=0) if len(self.parts[e]) > 1 else self.parts[e][0]
            for dim, (offset, length) in enumerate(zip(offsets[1:], lengths[1:], strict=True)):
                one = one.narrow(dim, offset, length)
            experts.append(one)
        if not experts:
            return torch.empty(0, *lengths[1:], dtype=self.dtype)
        return torch.stack(experts)
