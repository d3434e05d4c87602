"""A mixture-of-experts feed-forward for Cuboid's Llama (``LlamaConfig(n_experts=E)``): a top-k softmax router,
packed experts (SwiGLU, ``gate_up_proj``: experts x 2·ffn x dim, ``down_proj``: experts x dim x ffn, the layout
transformers 5 keeps), an optional shared expert, and the load-balancing loss of the Switch Transformer.

Plain PyTorch, no parallelism: ``cuboid.experts`` splits the packed experts over ranks and replaces the experts'
``forward`` (same signature as transformers' experts implementations) with its all-to-all exchange; whether one
grouped GEMM runs is its :func:`~cuboid.experts.grouped_mm_runs`, which both forwards ask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuboid.experts import grouped_mm_runs


class Router(nn.Module):
    """Softmax over the experts, the top ``k`` chosen per token, their weights renormalised to sum to 1."""

    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``(tokens, dim)`` -> (router probabilities ``(tokens, E)``, top-k weights, top-k expert ids)."""
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        return probs, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), index


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts in two packed parameters; ``forward`` runs each chosen (token, expert) pair
    and sums a token's k results weighted by the router (pairs sorted by expert; one grouped GEMM per projection
    where ``F.grouped_mm`` runs, else an exact loop over the experts)."""

    has_gate, has_bias, is_transposed, has_post_expert_norm = True, False, False, False

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.num_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def act_fn(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        binned = torch.zeros(self.num_experts + 1, dtype=torch.long, device=flat.device)
        counts = binned.index_add_(0, flat.clamp(max=self.num_experts), torch.ones_like(flat))
        rows = x.index_select(0, torch.div(order, top_k_index.shape[-1], rounding_mode="floor"))
        if grouped_mm_runs(x, *self.gate_up_proj.shape[-2:], self.down_proj.shape[-1]):  # no host read
            offs = counts[: self.num_experts].cumsum(0).to(torch.int32)
            up, down = (w.to(rows.dtype).transpose(-2, -1) for w in (self.gate_up_proj, self.down_proj))
            h = self._apply_gate(F.grouped_mm(rows, up, offs=offs))
            out = F.grouped_mm(h, down, offs=offs)
            valid = (flat.index_select(0, order) < self.num_experts).unsqueeze(-1)  # rows past the last expert's
            pairs = x.new_zeros(flat.numel(), x.shape[-1]).index_copy(0, order, torch.where(valid, out, 0.0))
            weighted = pairs * top_k_weights.reshape(-1, 1).to(pairs.dtype)
            return weighted.view(*top_k_index.shape, -1).sum(dim=1)
        sizes = counts[: self.num_experts].tolist()  # one host read per layer
        outs, start = [], 0
        for e, n in enumerate(sizes):
            h = self._apply_gate(F.linear(rows[start : start + n], self.gate_up_proj[e]))
            outs.append(F.linear(h, self.down_proj[e]))
            start += n
        pairs = x.new_zeros(flat.numel(), x.shape[-1]).index_copy(0, order[:start], torch.cat(outs))
        weighted = pairs * top_k_weights.reshape(-1, 1).to(pairs.dtype)
        return weighted.view(*top_k_index.shape, -1).sum(dim=1)


class MoE(nn.Module):
    """The feed-forward of an MoE block: routed experts (+ a shared expert). After each forward, ``aux_loss`` holds
    this call's load-balancing loss ``E · sum_e f_e · P_e`` (``f_e``: fraction of the chosen pairs that went to
    expert ``e``; ``P_e``: its mean router probability), which the LM adds to its loss, weighted. The statistic's
    parts (per-expert choice counts, probability sums, tokens) stay in ``balance_parts``, and :meth:`balance_loss`
    makes the loss from parts summed over any set of tokens (how a strategy makes it the whole batch's)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.router = Router(dim, n_experts, top_k)
        self.experts = Experts(dim, hidden, n_experts)
        self.shared_expert = shared
        self.aux_loss: torch.Tensor | None = None
        self.balance_parts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs, weights, index = self.router(flat)
        out = self.experts(flat, index, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        counts = torch.zeros_like(probs).scatter_(1, index, 1.0).sum(dim=0)
        self.balance_parts = torch.cat([counts, probs.sum(dim=0), counts.new_full((1,), probs.shape[0])])
        self.aux_loss = self.balance_loss(self.balance_parts)
        return out.view_as(x)

    def balance_loss(self, parts: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of ``balance_parts`` (``[counts (E), probability sums (E), tokens]``)."""
        n, k = self.router.weight.shape[0], self.router.top_k
        tokens = parts[2 * n]
        return n * (parts[:n] / (tokens * k) * (parts[n : 2 * n] / tokens)).sum()
