"""Cuboid's Llama and Hugging Face's ``LlamaForCausalLM``: parameter names, ``config.json`` contents, and the
check that a ``config.json`` describes the same model. The mapping lives in the library
(:mod:`cuboid.checkpoint.hf_llama`, which the export and ``pretrained=`` use); its names are importable from here
as before."""

from cuboid.checkpoint import check_hf_config, has_hf_name, hf_config, hf_name, to_hf_llama, to_hf_llama_adapter

__all__ = ["check_hf_config", "has_hf_name", "hf_config", "hf_name", "to_hf_llama", "to_hf_llama_adapter"]
