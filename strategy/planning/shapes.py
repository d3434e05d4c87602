"""What the planner reasons about: a model's shape (:class:`Shape`, from a named size or a Hugging Face
config), a GPU and its links (:class:`Hardware`, :data:`GPUS`), and how it trains (:class:`Setup`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from cuboid.parallel import Layout

GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped decoder's sizes (Llama, Mistral, Qwen2 and Qwen3 included: a query width other than ``dim``
    through ``head_dim``, Qwen2's q/k/v biases, Qwen3's per-head q/k norms). Parameters and FLOPs follow the query
    width; the activation count takes query-sized tensors as ``dim``-sized (exact when heads x head_dim = dim).

    Mixture of experts (``experts > 0``: Qwen3-MoE, Mixtral, Cuboid's ``LlamaConfig(n_experts=...)``): every block's
    feed-forward is a router (``experts x dim``), ``experts`` SwiGLU experts of width ``moe_ffn`` of which each token
    uses ``top_k``, and a shared expert of width ``shared_ffn`` if any. :attr:`params` counts every expert,
    :attr:`active_params` the ``top_k`` a token uses (FLOPs follow the active count)."""

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
    experts: int = 0  # routed experts per block (0: a dense feed-forward of width ffn)
    top_k: int = 0
    moe_ffn: int = 0  # one expert's width
    shared_ffn: int = 0  # the shared expert's width (0: none)

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
        moe = {}
        if getattr(c, "n_experts", 0):
            moe = {"experts": c.n_experts, "top_k": c.top_k, "moe_ffn": c.moe_ffn_dim or c.ffn_dim,
                   "shared_ffn": c.ffn_dim if c.shared_expert else 0}  # fmt: skip
        return cls(c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, c.tie_embeddings, **moe)

    @classmethod
    def from_hf_config(cls, path: str) -> Shape:
        """From a Hugging Face ``config.json`` of a Llama-family decoder, dense or mixture-of-experts (read with
        transformers' own ``AutoConfig``, so its defaults apply); other architectures are refused by name."""
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
        if kind not in ("llama", "mistral", "qwen2", "qwen3", *MOE_KINDS):
            raise ValueError(
                f"model={path!r} is model_type {kind!r}: the planner models Llama-family decoders (llama, mistral, "
                f"qwen2, qwen3) and their mixture-of-experts kin ({', '.join(MOE_KINDS)}). Setup still checks any "
                "model's parameter bytes against the GPU (cuboid.measure)."
            )
        moe = _moe_of(c, kind, path)
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
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            **moe,
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
        """Parameters of a block that tensor parallelism shards (the projections, and q/k/v biases if any; none of
        an MoE block's feed-forward, which Cuboid keeps whole on every tp rank: :attr:`block_experts`)."""
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        dense = 0 if self.experts else self.ffn
        return 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim + 3 * self.dim * dense + bias

    @property
    def block_experts(self) -> int:
        """An MoE block's routed experts (all of them; 0 for a dense block)."""
        return self.experts * 3 * self.dim * self.moe_ffn

    @property
    def block_router(self) -> int:
        """An MoE block's router and shared expert (whole on every tp rank, like the experts)."""
        return self.experts * self.dim + 3 * self.dim * self.shared_ffn

    @property
    def ffn_active(self) -> int:
        """The feed-forward width one token goes through: ``ffn``, or ``top_k`` experts and the shared one."""
        return self.top_k * self.moe_ffn + self.shared_ffn if self.experts else self.ffn

    @property
    def block_norms(self) -> int:
        return 2 * self.dim + (2 * self.hd if self.qk_norm else 0)

    @property
    def params(self) -> int:
        heads = 1 if self.tied else 2
        block = self.block_tp + self.block_norms + self.block_experts + self.block_router
        return self.layers * block + heads * self.vocab * self.dim + self.dim

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: an MoE block's ``top_k`` experts of ``experts``."""
        idle = self.block_experts - self.top_k * 3 * self.dim * self.moe_ffn if self.experts else 0
        return self.params - self.layers * idle

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token: 6 x matmul parameters (the active ones; the embedding lookup excluded) + 12 x
        layers x dim x seq (attention), as ANCHORS.md."""
        matmul = self.active_params - (0 if self.tied else self.vocab * self.dim)
        return 6 * matmul + 12 * self.layers * self.q_dim * seq


MOE_KINDS = ("qwen3_moe", "mixtral")


def _moe_of(c: object, kind: str, path: str) -> dict[str, int]:
    """The mixture-of-experts fields of a Hugging Face config: Qwen3-MoE (``num_experts``, ``moe_intermediate_size``;
    every layer sparse) and Mixtral (``num_local_experts``, experts of ``intermediate_size``)."""
    if kind == "mixtral":
        return {"experts": c.num_local_experts, "top_k": c.num_experts_per_tok, "moe_ffn": c.intermediate_size}
    if kind == "qwen3_moe":
        if getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"model={path!r} mixes dense and mixture-of-experts layers (mlp_only_layers="
                f"{getattr(c, 'mlp_only_layers', None)}, decoder_sparse_step={getattr(c, 'decoder_sparse_step', 1)}): "
                "the planner models every layer alike. Plan the all-sparse config instead."
            )
        return {"experts": c.num_experts, "top_k": c.num_experts_per_tok, "moe_ffn": c.moe_intermediate_size}
    return {}


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the links between GPUs. Bandwidths are per GPU, one direction, as a ring collective's
    bus bandwidth reaches them (assumed from vendors' figures, not measured here)."""

    name: str
    memory: float  # bytes
    peak: dict[str, float]  # dense FLOP/s by math: "bf16", "fp8", "fp32"
    hbm: float  # bytes/s
    # NVLink 4 (900 GB/s both directions, 450 each way) as NCCL reaches it: about 370 GB/s bus bandwidth for
    # all-gather and reduce-scatter on 8 H100 SXM, after its protocol's ~20% (NCCL's maintainer,
    # github.com/NVIDIA/nccl-tests/issues/212 and github.com/NVIDIA/nccl/issues/1442; 350-370 measured in nccl#1281)
    nvlink: float = 370e9
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


_DEGREES = tuple(f.name for f in fields(Layout))  # pp, dp_replicate, dp_shard, cp, tp, ep: the mesh's order


@dataclass(frozen=True, init=False)
class Setup:
    """How a model trains: the layout (a :class:`~cuboid.parallel.Layout`, the one record of the degrees) and
    everything else that changes memory or time. Made as ``Setup(dp_shard=8, tp=2, batch=2, ...)``: the degrees by
    their layout names go into :attr:`layout` (``dp_shard`` defaults to 1 here), and ``s.tp`` etc. read them back."""

    layout: Layout
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
    balance: bool = False  # an MoE's load-balancing loss in the loss, its statistic summed over the ranks ("global")
    repeat_kv: bool = False  # the model repeats its KV heads to the query heads before attention (torchtitan's Llama):
    # attention saves, and context parallel exchanges, q_dim-wide keys and values; Cuboid's keep the real KV heads
    cp_rotate: str | None = None  # context parallel's attention: None, Cuboid's block attention; "allgather" or
    # "alltoall", torch's ring attention (torch.distributed.tensor.experimental.context_parallel, as torchtitan runs
    # it) with that rotate method

    def __init__(self, layout: Layout | None = None, **settings: Any) -> None:
        degrees = {name: settings.pop(name) for name in _DEGREES if name in settings}
        if layout is not None and degrees:
            raise TypeError(f"Setup: give the degrees in layout= or by name, not both ({sorted(degrees)}).")
        object.__setattr__(self, "layout", layout if layout is not None else Layout(**{"dp_shard": 1, **degrees}))
        for f in fields(self)[1:]:
            object.__setattr__(self, f.name, settings.pop(f.name, f.default))
        if settings:
            raise TypeError(f"Setup got unknown settings {sorted(settings)}.")

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def m(self) -> int:
        from cuboid.pipeline import default_microbatches

        return self.microbatches or default_microbatches(self.pp, self.virtual_stages)


# s.pp, s.dp_replicate, s.dp_shard, s.cp, s.tp, s.ep: read from the layout (a degree added to Layout reads here too)
for _degree in _DEGREES:
    setattr(Setup, _degree, property(lambda self, name=_degree: getattr(self.layout, name)))
