"""Cuboid's reference Llama and Hugging Face's ``LlamaForCausalLM``: parameter names, ``config.json`` contents, the
check that a ``config.json`` describes the same model (for ``pretrained=`` and the export), and the shape an
export's ``--hf`` names. The library's side of the mapping: ``cuboid.models`` imports it from here, and nothing here
imports the models; a shape is any object with :class:`LlamaShape`'s fields (``cuboid.models.LlamaConfig``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# What a ``--hf`` YAML builds, as Hydra's ``model=`` does (conf/model/*.yaml name it in their ``_target_``).
LLAMA_CONFIG = "cuboid.models.LlamaConfig"


class LlamaShape(Protocol):
    """The fields of a Llama-style model's shape that its Hugging Face ``config.json`` holds."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    norm_eps: float
    rope_theta: float
    rope_scaling: float | None
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_seq_len: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int: ...


# Hugging Face ``LlamaForCausalLM`` parameter names, as (our suffix, theirs) per block and outside. The weights
# themselves are laid out alike (rotate-half rotary pairs), so the names are the whole mapping.
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


def has_hf_name(name: str) -> bool:
    """Whether one of our parameter names (relative to ``cuboid.models.Llama``) has a Hugging Face
    ``LlamaForCausalLM`` name (an MoE block's experts and router have none)."""
    parts = name.split(".", 2)
    return name in _HF_OTHER_NAMES or (len(parts) == 3 and parts[0] == "layers" and parts[2] in _HF_BLOCK_NAMES)


def hf_name(name: str) -> str:
    """The Hugging Face ``LlamaForCausalLM`` name of one of our parameter names (relative to
    ``cuboid.models.Llama``)."""
    if name in _HF_OTHER_NAMES:
        return _HF_OTHER_NAMES[name]
    _, index, suffix = name.split(".", 2)  # layers.<i>.<suffix>
    return f"model.layers.{index}.{_HF_BLOCK_NAMES[suffix]}"


def hf_config(cfg: LlamaShape) -> dict:
    """The ``config.json`` contents of the Hugging Face ``LlamaForCausalLM`` equal to ``cfg``."""
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
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if cfg.rope_scaling is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    return config


def check_hf_config(cfg: LlamaShape, config: dict) -> list[str]:
    """Where a Hugging Face ``config.json`` describes another model than ``cfg`` (empty when they agree)."""
    ours = hf_config(cfg)
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theirs = {**config, "rope_theta": config.get("rope_theta", scaling.get("rope_theta"))}
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rope_theta", "tie_word_embeddings", "rms_norm_eps"]  # fmt: skip
    wrong = [f"{k}: {theirs.get(k)!r} there, {ours[k]!r} here" for k in keys if k in theirs and theirs[k] != ours[k]]
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling.get("factor")
        if factor != cfg.rope_scaling:
            wrong.append(f"rope scaling factor: {factor!r} there, {cfg.rope_scaling!r} here")
    elif cfg.rope_scaling is not None:
        wrong.append(f"rope scaling: none there, llama3 x{cfg.rope_scaling} here")
    return wrong


def to_hf_llama(state: dict[str, torch.Tensor], cfg: LlamaShape) -> tuple[dict[str, torch.Tensor], dict]:
    """Our Llama's weights (names relative to the model) as a Hugging Face ``LlamaForCausalLM`` state dict, plus
    the matching ``config.json`` contents. A tied output head is left out, as Hugging Face saves it."""
    skip = {"output.weight"} if cfg.tie_embeddings else set()
    return {hf_name(name): tensor for name, tensor in state.items() if name not in skip}, hf_config(cfg)


def to_hf_llama_adapter(tensors: dict, config: dict) -> tuple[dict, dict]:
    """A LoRA adapter trained on ``cuboid.models.Llama`` (PEFT's names:
    ``base_model.model.layers.0.attention.wq.lora_A.weight``) as the same adapter on a Hugging Face ``LlamaForCausalLM`` (``...model.layers.0.self_attn.q_proj
    .lora_A.weight``), with its ``adapter_config.json`` fields' ``target_modules`` renamed alike. The weights are
    laid out alike, so only names change."""
    modules = {ours.rsplit(".", 1)[0].split(".")[-1]: theirs.rsplit(".", 1)[0].split(".")[-1]
               for ours, theirs in _HF_BLOCK_NAMES.items() if not ours.endswith("norm.weight")}  # fmt: skip
    out = {}
    for name, tensor in tensors.items():
        module, part = name.removeprefix("base_model.model.").split(".lora_", 1)
        out[f"base_model.model.{hf_name(module + '.weight').removesuffix('.weight')}.lora_{part}"] = tensor
    targets = config.get("target_modules")
    if isinstance(targets, list):
        targets = sorted(modules.get(t, t) for t in targets)
    elif isinstance(targets, str):
        targets = modules.get(targets, targets)
    return out, {**config, "target_modules": targets}


def llama_shape(spec: str) -> LlamaShape:
    """The reference Llama's shape an export's ``--hf`` names: a named size (``conf/model/<spec>.yaml``, written
    from ``cuboid.models.CONFIGS`` and checked against it) or a YAML file of its fields, the rest at their
    defaults."""
    from importlib import import_module, resources

    from omegaconf import OmegaConf

    named = resources.files("cuboid.conf") / "model" / f"{spec}.yaml"
    is_named = Path(spec).name == spec and named.is_file()
    loaded = OmegaConf.create(named.read_text()) if is_named else OmegaConf.load(spec)
    fields = OmegaConf.to_container(loaded)
    fields.pop("_target_", None)
    module, _, name = LLAMA_CONFIG.rpartition(".")
    return getattr(import_module(module), name)(**fields)
