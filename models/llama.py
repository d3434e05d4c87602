"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU and grouped-query attention.

The file holds the architecture and nothing else, in the manner of nanoGPT and torchtitan's
model files. It imports no ``torch.distributed``: the way the model is split across devices
lives in ``cuboid`` (``strategy/``), which reads two plain-data hints from here:

* :data:`TP_PLAN`, a mapping of module-name glob to tensor-parallel style string;
* the pipeline-ready shape: ``tok_embeddings -> layers (a ModuleDict keyed "0", "1", ...)
  -> norm -> output``, where any of the outer pieces may be ``None`` (a pipeline stage keeps
  only what it owns) and ``forward`` skips what is missing.

Attention reshapes with ``view(b, s, -1, head_dim)``, so the local number of heads follows
the (possibly sharded) projection weight rather than the config.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cuboid.models.config import CONFIGS, LlamaConfig
from cuboid.models.hf_llama import check_hf_config, has_hf_name, hf_config, hf_name, to_hf_llama
from cuboid.models.moe import MoE

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "check_hf_config", "hf_config", "hf_name", "to_hf_llama"]


# Tensor-parallel plan as plain data: module-name glob (relative to the Llama module) -> style.
# Cuboid turns the styles into DTensor parallel styles (cuboid.parallel.plans).
# Sequence parallel between the blocks' projections (norms and residuals on sequence-sharded activations) and
# loss parallel at the output (logits stay vocabulary-sharded), as torchtitan's Llama plan.
TP_PLAN: dict[str, str] = {
    "tok_embeddings": "embedding_sequence",
    "layers.*.attention_norm": "sequence_parallel",
    "layers.*.attention": "gather_sequence",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise_sequence",
    "layers.*.ffn_norm": "sequence_parallel",
    "layers.*.feed_forward": "gather_sequence",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise_sequence",
    "norm": "sequence_parallel",
    "output": "loss_parallel",
}
# A mixture-of-experts Llama (LlamaConfig(n_experts=...)): attention as above; each block's MoE feed-forward runs
# whole on every tp rank on the gathered sequence (its router and experts are not split over tp; expert parallel
# splits the experts over other ranks), its output split back along the sequence.
TP_PLAN_MOE: dict[str, str] = {
    **{k: v for k, v in TP_PLAN.items() if not k.startswith("layers.*.feed_forward")},
    "layers.*.feed_forward": "replicated_sequence",
}
# The same split of the weights with replicated activations and gathered (plain) logits: every rank holds the whole
# sequence between the blocks' projections, and ``self.model(x)`` returns a plain tensor.
TP_PLAN_NO_SP: dict[str, str] = {
    "tok_embeddings": "embedding",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "output": "output",
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_frequencies(cfg: LlamaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotary inverse frequencies (fp32, ``head_dim // 2``), with Llama 3's scaling when ``cfg.rope_scaling`` is set:
    wavelengths longer than ``original / low_freq_factor`` are divided by the factor, shorter than ``original /
    high_freq_factor`` kept, and the band between interpolated smoothly (Hugging Face's "llama3" rope type).

    Made on ``device`` (default: the host) by a few elementwise kernels there, with no host tensor and no copy:
    the model's forward makes them on its input's device, so a GPU step waits on no host-to-device transfer."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_scaling is None:
        return inv_freq
    factor, low, high, old = (
        cfg.rope_scaling, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len
    )  # fmt: skip
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_cache(positions: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary angles of ``positions`` (a length: ``0 .. n-1``; or position ids, ``(seq,)`` or ``(b, seq)``) as a
    ``(seq, head_dim, 2)`` (or ``(b, seq, head_dim, 2)``) tensor of cos and sin (fp32); the frequencies repeat over
    the two halves of a head (the rotate-half layout of Hugging Face's Llama)."""
    if isinstance(positions, int):
        positions = torch.arange(positions, device=inv_freq.device)
    angles = positions.to(inv_freq.device, torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(b, s, heads, head_dim)``: the first half of each head pairs with the second."""
    xf = x.float()
    rope = rope if rope.dim() == 4 else rope.unsqueeze(0)
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # Rotary angles for this input's tokens (here, not in Llama.forward: between blocks the hidden state may be
        # a slice of the sequence, as under sequence parallelism); ``position_ids`` default to 0 .. s-1.
        rope = rope_cache(s if position_ids is None else position_ids, rope_frequencies(self.cfg, x.device))
        # -1, not n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        # Grouped-query heads go to attention as they are (enable_gqa), not repeated: what context parallel gathers
        # over its ranks is then the model's own key/value heads (n_heads / n_kv_heads times fewer bytes).
        gqa = q.shape[2] != k.shape[2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = FeedForward(cfg.dim, cfg.ffn_dim)
        if cfg.n_experts:
            shared = FeedForward(cfg.dim, cfg.ffn_dim) if cfg.shared_expert else None
            self.feed_forward = MoE(cfg.dim, cfg.moe_ffn_dim or cfg.ffn_dim, cfg.n_experts, cfg.top_k, shared)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), position_ids=position_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only transformer. ``forward(tokens)`` returns logits ``(b, s, vocab)``.

    Pipeline-ready: when ``tok_embeddings`` is ``None`` the input is already a hidden state;
    when ``norm``/``output`` are ``None`` the hidden state is returned as is.
    """

    def __init__(self, cfg: LlamaConfig | str = "debug") -> None:
        super().__init__()
        self.cfg = CONFIGS[cfg] if isinstance(cfg, str) else cfg
        c = self.cfg
        self.tp_plan = TP_PLAN_MOE if c.n_experts else TP_PLAN
        # init_weights() below is the one source of initial values. Layers draw default inits while
        # they are built; rewind the RNG so a model built here gets exactly what init_weights() alone
        # gives from this RNG state (as when Cuboid materializes a meta-device model).
        rng = torch.get_rng_state()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(c) for i in range(c.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(c.dim, c.norm_eps)
        self.output: nn.Linear | None = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        torch.set_rng_state(rng)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter from the global RNG, in a fixed order.

        Normal(0, 0.02) for embeddings and projections, scaled by ``1/sqrt(2 * n_layers)`` for
        the projections that feed the residual stream; ones for norms. On the meta device this
        is a no-op, and Cuboid calls it again once the weights have real storage.
        """
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight  # re-tie: to_empty() gives each name its own tensor
        std = 0.02
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("attention.wo.weight", "w2.weight", "experts.down_proj")):
                nn.init.normal_(p, 0.0, residual_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def aux_loss(self) -> torch.Tensor | None:
        """The sum of this model's MoE blocks' load-balancing losses from their last forward (None when dense)."""
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def pretrained_names(self) -> dict[str, str]:
        """State-dict adapter for ``CuboidStrategy(pretrained=...)``: each of our parameter names -> its name in a
        Hugging Face Llama weights file (a tied output head maps to the embedding, as the file holds one)."""
        names = {}
        for name, _ in self.named_parameters(remove_duplicate=False):
            # a projection wrapped by an adapter library keeps its own weight under ``base_layer`` (PEFT's LoRA);
            # the adapter's tensors are in no Hugging Face file
            own = name.replace(".base_layer.", ".")
            if has_hf_name(own):
                names[name] = hf_name(own)
        if self.cfg.tie_embeddings:
            names["output.weight"] = names["tok_embeddings.weight"]
        return names

    def check_pretrained_config(self, config: dict) -> list[str]:
        """Differences between this model and a Hugging Face ``config.json`` found beside the weights."""
        return check_hf_config(self.cfg, config)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(b, s, vocab)`` of ``tokens`` ``(b, s)``; ``position_ids`` (``(s,)`` or ``(b, s)``, default
        ``0 .. s-1``) are the tokens' positions in their sequences, for the rotary embedding."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, position_ids=position_ids)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
