"""A tensor-parallel plan read from a model's structure, for a model that carries none (Mllama, Llama 3.2 Vision).

transformers gives most decoders a plan (``base_model_tp_plan``); some families ship without one. Their blocks
are still the layers every Llama-like decoder is made of, and :func:`derive_plan` writes the plan those layers take,
as data (``{glob: style}``, printed at setup, a user's to copy and edit), from what each block holds:

* an **attention** module: a module with four ``nn.Linear`` children ``q_proj``, ``k_proj``, ``v_proj`` and
  ``o_proj`` (self-attention, or cross-attention whose keys and values are projected from other states, the
  image's). The three projections split colwise (each rank its share of the heads), ``o_proj`` rowwise (the
  heads' outputs summed over tp); any other child with parameters (per-head query/key norms, applied to the
  heads after the split) stays whole, its gradient summed over tp (``replicated_with_grad_allreduce``); and the
  module itself gets ``local_heads`` (:class:`LocalHeads`): its head counts are this rank's, for a forward that
  reshapes by them (``view(bsz, q_len, self.num_heads, self.head_dim)`` would fail on a share of the heads, and
  ``view(bsz, -1, self.num_key_value_heads, self.head_dim)`` would silently mix heads into the sequence);
* a gated **MLP**: ``nn.Linear`` children ``gate_proj``, ``up_proj`` and ``down_proj`` (or ``up_proj`` and
  ``down_proj``): the first colwise, ``down_proj`` rowwise.

The embedding, the head, the norms between the blocks and whatever the blocks do not hold (a vision tower)
run whole on every tp rank, their gradients equal there. Each of these splits is the one transformers' own plans
give a Llama's layers; the parity tests run Mllama's, its self- and cross-attention layers, at tp2 against one
process.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

# The head counts an attention module (or its config) keeps: checked against tp before any work
# (``plans.check_tp_divisibility``), and made this rank's by ``local_heads``.
HEAD_COUNTS = ("n_heads", "n_kv_heads", "num_heads", "num_key_value_heads", "num_attention_heads", "num_kv_heads")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLPS = (("gate_proj", "up_proj", "down_proj"), ("up_proj", "down_proj"))


def derive_plan(blocks: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """The plan for ``blocks`` (``[(name, block)]`` from :func:`cuboid.parallel.plans.find_blocks`, names as seen
    from the LightningModule), by structure; empty when the blocks hold no layer it knows. Keys are globs over
    the blocks' container (``model.model.language_model.layers.*.cross_attn.q_proj``), so blocks of different
    classes (self- and cross-attention layers) share the entries their modules share."""
    plan: dict[str, str] = {}
    for name, block in blocks:
        container = name.rpartition(".")[0]
        prefix = f"{container}.*." if container else "*."
        for path, module in block.named_modules():
            children = dict(module.named_children())
            at = f"{prefix}{path}." if path else prefix
            if _linears(children, _ATTENTION):
                plan[at.rstrip(".")] = "local_heads"
                for part in _ATTENTION[:3]:
                    plan[at + part] = "colwise"
                plan[at + "o_proj"] = "rowwise"
                for other, child in children.items():
                    if other not in _ATTENTION and any(True for _ in child.parameters()):
                        plan[at + other] = "replicated_with_grad_allreduce"
                continue
            for parts in _MLPS:
                if _linears(children, parts):
                    for part in parts[:-1]:
                        plan[at + part] = "colwise"
                    plan[at + parts[-1]] = "rowwise"
                    break
    return plan


def _linears(children: dict[str, nn.Module], names: tuple[str, ...]) -> bool:
    return all(type(children.get(n)) is nn.Linear for n in names)


class LocalHeads(ParallelStyle):
    """``local_heads``: an attention module whose projections are split over tp keeps this rank's head counts
    (:data:`HEAD_COUNTS`, those it holds as attributes, each divided by the tp size, which
    ``check_tp_divisibility`` found to divide them before any work); nothing else changes. The whole counts are kept
    on the module, so a second application (a second ``fit``) divides them once."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        whole: dict[str, Any] = module.__dict__.setdefault(
            "_cuboid_whole_heads",
            {a: getattr(module, a) for a in HEAD_COUNTS if isinstance(getattr(module, a, None), int)},
        )
        for attr, heads in whole.items():
            setattr(module, attr, heads // device_mesh.size())
        return module
