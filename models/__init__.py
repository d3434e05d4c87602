"""Reference models for Cuboid. Plain PyTorch: no parallelism lives here."""

from cuboid.models.llama import CONFIGS, TP_PLAN, Llama, LlamaConfig
from cuboid.models.lm import CausalLM

__all__ = ["CONFIGS", "TP_PLAN", "CausalLM", "Llama", "LlamaConfig"]
