"""What the planner reasons about: a model's shape (:class:`Shape`, from a named size or a Hugging Face
config), a GPU and its links (:class:`Hardware`, :data:`GPUS`), and how it trains (:class:`Setup`)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped decoder's sizes (Llama, Mistral, Qwen2 and Qwen3 included: a query width other than ``dim``
    through ``head_dim``, Qwen2's q/k/v biases, Qwen3's per-head q/k norms). Parameters and FLOPs follow the query
    width; the activation count takes query-sized tensors as ``dim``-sized (exact when heads x head_dim = dim)."""

    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    head_dim: int = 0  # 0: dim // heads
    qkv_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def of(cls, model: str | object) -> Shape:
        """From a named size of :data:`cuboid.models.CONFIGS` (``"8b"``, ``"70b"``, ``"405b"``), a Hugging Face
        ``config.json`` (its path, or the directory holding it), or a LlamaConfig."""
        if isinstance(model, str):
            if model == "405b":  # Llama 3.1 405B (its model card; too large for CONFIGS' tests)
                return cls(126, 16384, 128, 8, 53248, 128256)
            from cuboid.models import CONFIGS

            if model.endswith(".json") or "/" in model:
                return cls.from_hf_config(model)
            if model not in CONFIGS:
                raise ValueError(
                    f"model={model!r}: choose one of {sorted([*CONFIGS, '405b'])}, or give the path of a Hugging "
                    "Face config.json (or its directory)."
                )
            model = CONFIGS[model]
        c = model
        return cls(c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, c.tie_embeddings)

    @classmethod
    def from_hf_config(cls, path: str) -> Shape:
        """From a Hugging Face ``config.json`` of a dense Llama-family decoder (read with transformers' own
        ``AutoConfig``, so its defaults apply); mixture-of-experts and other architectures are refused by name."""
        from pathlib import Path

        try:
            from transformers import AutoConfig
        except ImportError as err:
            raise ValueError(f"model={path!r}: reading a Hugging Face config needs transformers (pip install "
                             "transformers).") from err  # fmt: skip
        where = Path(path)
        folder = where.parent if where.name.endswith(".json") else where
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model={path!r}: no config.json there (give a Hugging Face config.json or its directory)."
            )
        c = AutoConfig.from_pretrained(str(folder))
        kind = getattr(c, "model_type", "?")
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
        if experts or kind not in ("llama", "mistral", "qwen2", "qwen3"):
            what = f"a mixture-of-experts model ({experts} experts)" if experts else f"model_type {kind!r}"
            raise ValueError(
                f"model={path!r} is {what}: the planner models dense Llama-family decoders (llama, mistral, qwen2, "
                "qwen3). Setup still checks any model's parameter bytes against the GPU (cuboid.planning.capacity)."
            )
        heads = c.num_attention_heads
        return cls(
            layers=c.num_hidden_layers,
            dim=c.hidden_size,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            ffn=c.intermediate_size,
            vocab=c.vocab_size,
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            qkv_bias=kind == "qwen2" or bool(getattr(c, "attention_bias", False)),
            qk_norm=kind == "qwen3",
        )

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def q_dim(self) -> int:
        return self.hd * self.heads

    @property
    def kv_dim(self) -> int:
        return self.hd * self.kv_heads

    @property
    def block_tp(self) -> int:
        """Parameters of a block that tensor parallelism shards (the projections, and q/k/v biases if any)."""
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim + 3 * self.dim * self.ffn + bias

    @property
    def block_norms(self) -> int:
        return 2 * self.dim + (2 * self.hd if self.qk_norm else 0)

    @property
    def params(self) -> int:
        heads = 1 if self.tied else 2
        return self.layers * (self.block_tp + self.block_norms) + heads * self.vocab * self.dim + self.dim

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token: 6 x matmul parameters (the embedding lookup excluded) + 12 x layers x dim x
        seq (attention), as ANCHORS.md."""
        matmul = self.params - (0 if self.tied else self.vocab * self.dim)
        return 6 * matmul + 12 * self.layers * self.q_dim * seq


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the links between GPUs. Bandwidths are per GPU, one direction, as a ring collective's
    bus bandwidth reaches them (assumed from vendors' figures, not measured here)."""

    name: str
    memory: float  # bytes
    peak: dict[str, float]  # dense FLOP/s by math: "bf16", "fp8", "fp32"
    hbm: float  # bytes/s
    nvlink: float = 450e9  # NVLink 4: 900 GB/s both directions
    network: float = 45e9  # 400 Gb/s per GPU, as NCCL reaches it
    alpha_nvlink: float = 10e-6  # seconds per collective step
    alpha_network: float = 25e-6
    gpus_per_node: int = 8


GPUS: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM 80GB", 80e9, {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12}, 3.35e12),
    # torchtitan's benchmark machines: H100 with 96 GB HBM2e at 2.4 TB/s and a 500 W limit.
    "h100-96gb": Hardware("H100 96GB HBM2e", 96 * GIB, {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12}, 2.4e12),
    "h200": Hardware("H200 SXM 141GB", 141e9, {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12}, 4.8e12),
    "a100": Hardware(
        "A100 SXM 80GB", 80e9, {"bf16": 312e12, "fp8": 312e12, "fp32": 19.5e12}, 2.0e12, nvlink=230e9, network=22e9
    ),  # fmt: skip
}


@dataclass(frozen=True)
class Setup:
    """How a model trains: the layout and everything that changes memory or time."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    batch: int = 1  # sequences per data-parallel rank per optimizer step (the "local batch")
    seq: int = 8192
    precision: str = "bf16-mixed"  # "bf16-mixed" | "32-true" | "bf16-true"
    ac: str | None = None  # None | "selective" (Cuboid's: every matmul kept) | "selective_op" (torchtitan's) | "full"
    cpu_offload: bool = False
    microbatches: int | None = None  # pp only: default Cuboid's, 2 x pp x virtual_stages
    schedule: str = "1F1B"  # "GPipe" | "1F1B" | "Interleaved1F1B"
    virtual_stages: int = 1
    compile: bool = False
    fp8: bool = False  # float8 matmuls (torchao), and float8 FSDP all-gathers
    async_tp: bool = False
    reshard_after_forward: bool | None = None  # None: Cuboid's default (True without pp, False with)
    cp: int = 1  # context parallel: each sequence split over cp ranks; FSDP shards over dp_shard x cp

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def m(self) -> int:
        from cuboid.pipeline.stages import default_microbatches

        return self.microbatches or default_microbatches(self.pp, self.virtual_stages)
