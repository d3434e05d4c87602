"""Reference models for Cuboid. Plain PyTorch: no parallelism lives here."""

from cuboid.models.llama import CONFIGS, TP_PLAN, TP_PLAN_MOE, TP_PLAN_NO_SP, Llama, LlamaConfig
from cuboid.models.lm import CausalLM

__all__ = ["CONFIGS", "TP_PLAN", "TP_PLAN_MOE", "TP_PLAN_NO_SP", "CausalLM", "Llama", "LlamaConfig"]
