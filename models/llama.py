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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style model. ``ffn_dim`` is the SwiGLU hidden size."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 192
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count (embedding and output head counted separately, untied)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim


# Named sizes, one registry of plain data (litgpt-style; conf/model/*.yaml are generated from it by
# scripts/model_configs.py). 8b and 70b follow Meta's Llama 3.1 model cards, 1b the Llama 3.2 1B shape (embeddings untied here: 1.5B parameters);
# 150m is a GPT-2-small-sized member of the family (153M).
CONFIGS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(),
    "150m": LlamaConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=3072, max_seq_len=2048
    ),
    "1b": LlamaConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=8192
    ),
    "8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "70b": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}

# Tensor-parallel plan as plain data: module-name glob (relative to the Llama module) -> style.
# Cuboid turns the styles into DTensor parallel styles (cuboid.plans).
TP_PLAN: dict[str, str] = {
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


def rope_cache(seq_len: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """Rotary angles as a ``(seq_len, head_dim // 2, 2)`` tensor of cos and sin (fp32)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(b, s, heads, head_dim)`` by the angles in ``rope``."""
    xr = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
    real = xr[..., 0] * cos - xr[..., 1] * sin
    imag = xr[..., 0] * sin + xr[..., 1] * cos
    return torch.stack((real, imag), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1, not n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        n_rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
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
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only transformer. ``forward(tokens)`` returns logits ``(b, s, vocab)``.

    Pipeline-ready: when ``tok_embeddings`` is ``None`` the input is already a hidden state;
    when ``norm``/``output`` are ``None`` the hidden state is returned as is.
    """

    tp_plan = TP_PLAN

    def __init__(self, cfg: LlamaConfig | str = "debug") -> None:
        super().__init__()
        self.cfg = CONFIGS[cfg] if isinstance(cfg, str) else cfg
        c = self.cfg
        # init_weights() below is the one source of initial values. Layers draw default inits while
        # they are built; rewind the RNG so a model built here gets exactly what init_weights() alone
        # gives from this RNG state (as when Cuboid materializes a meta-device model).
        rng = torch.get_rng_state()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(c) for i in range(c.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(c.dim, c.norm_eps)
        self.output: nn.Linear | None = nn.Linear(c.dim, c.vocab_size, bias=False)
        torch.set_rng_state(rng)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter from the global RNG, in a fixed order.

        Normal(0, 0.02) for embeddings and projections, scaled by ``1/sqrt(2 * n_layers)`` for
        the projections that feed the residual stream; ones for norms. On the meta device this
        is a no-op, and Cuboid calls it again once the weights have real storage.
        """
        std = 0.02
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                nn.init.normal_(p, 0.0, residual_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = rope_cache(h.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device)
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


# Hugging Face ``LlamaForCausalLM`` parameter names, as (our suffix, theirs) per block and outside.
_HF_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_HF_OTHER_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _rope_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from interleaved rotary pairs (ours) to rotate-half (Hugging Face)."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_llama(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """Our Llama's weights (names relative to the model) as a Hugging Face ``LlamaForCausalLM``
    state dict, plus the matching ``config.json`` contents."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in _HF_OTHER_NAMES:
            out[_HF_OTHER_NAMES[name]] = tensor
            continue
        _, index, suffix = name.split(".", 2)  # layers.<i>.<suffix>
        if suffix == "attention.wq.weight":
            tensor = _rope_halves(tensor, cfg.n_heads)
        elif suffix == "attention.wk.weight":
            tensor = _rope_halves(tensor, cfg.n_kv_heads)
        out[f"model.layers.{index}.{_HF_BLOCK_NAMES[suffix]}"] = tensor
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    return out, config
