"""The shape of Cuboid's Llama-style model, :class:`LlamaConfig`, and its named sizes, :data:`CONFIGS` (plain data,
read by the model, by its Hugging Face mapping and by the planner)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONFIGS", "LlamaConfig"]


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
    # Llama 3's rotary frequency scaling ("llama3" rope type): ``rope_scaling`` is the factor (None: no scaling).
    rope_scaling: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # The output head shares the token embedding's weight (Llama 3.2 1B and 3B).
    tie_embeddings: bool = False
    # Mixture of experts (cuboid.models.moe): 0 = dense. Each block's feed-forward becomes n_experts SwiGLU experts
    # of moe_ffn_dim (default ffn_dim), top_k per token, plus one shared expert of ffn_dim if shared_expert; the LM
    # adds aux_loss_coef x the load-balancing loss.
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int | None = None
    shared_expert: bool = False
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, (int, float)):
            raise TypeError(f"LlamaConfig.rope_scaling={self.rope_scaling!r}: a number (the factor) or None.")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: dim={self.dim} must divide by n_heads={self.n_heads}, and n_heads by "
                f"n_kv_heads={self.n_kv_heads}."
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, active: bool = False) -> int:
        """Parameter count (a tied output head counted once); ``active``: an MoE block's experts counted top_k
        times instead of n_experts (the parameters one token's forward uses)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        if self.n_experts:
            experts = self.top_k if active else self.n_experts
            mlp = experts * 3 * self.dim * (self.moe_ffn_dim or self.ffn_dim) + self.n_experts * self.dim
            mlp += 3 * self.dim * self.ffn_dim if self.shared_expert else 0
        block = attn + mlp + 2 * self.dim
        heads = 1 if self.tie_embeddings else 2
        return self.n_layers * block + heads * self.vocab_size * self.dim + self.dim

    def matmul_params(self) -> int:
        """Parameters a token's forward multiplies with: all but the input embedding (a lookup), which a tied
        output head still uses as its matrix."""
        return self.num_params(active=True) - (0 if self.tie_embeddings else self.vocab_size * self.dim)


# Named sizes, one registry of plain data (litgpt-style; conf/model/*.yaml are generated from it by
# scripts/model_configs.py). 8b and 70b are Meta's Llama 3.1 8B and 70B, 1b and 3b Llama 3.2 1B and 3B (tied
# embeddings), field for field with their Hugging Face config.json; 150m is a GPT-2-small-sized member of the family.
_LLAMA31 = {"max_seq_len": 131072, "rope_theta": 500000.0, "rope_scaling": 8.0}
_LLAMA32 = {**_LLAMA31, "rope_scaling": 32.0, "tie_embeddings": True}
CONFIGS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(),
    "moe_debug": LlamaConfig(n_experts=4, top_k=2, moe_ffn_dim=96, shared_expert=True),
    "150m": LlamaConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=3072, max_seq_len=2048
    ),
    "1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, **_LLAMA32),
    "3b": LlamaConfig(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, **_LLAMA32),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **_LLAMA31),
    "70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_LLAMA31),
}
