"""Weight export, the code behind ``python -m cuboid.export``.

Writes a checkpoint's model weights (sharded or full, any training layout) to one safetensors file; a Hugging Face
directory for a transformers model (``--config``, its own names and config) or, for the reference Llama, a
``LlamaForCausalLM`` directory (``--hf``). Apart from the checkpoint core:
it is the only place that maps Cuboid's checkpoints onto a model family (the reference Llama's names and config, by
:mod:`cuboid.checkpoint.hf_llama`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from cuboid.adapters import peft_state_dict, write_peft_adapters
from cuboid.checkpoint.format import META_FILE, CheckpointError, check_loadable, load_pickled
from cuboid.checkpoint.hf_llama import llama_shape, to_hf_llama, to_hf_llama_adapter
from cuboid.storage import dcp_reader, to_path


def read_model_weights(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full model weights of a checkpoint (sharded or full), by original name, in one process.

    Needs no process group and no knowledge of the training layout; reads the model entries only
    (never the optimizer state).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = to_path(path)  # a local path, or a URL fsspec reaches (s3://...)
    check_loadable(path, allow_file=True)
    if path.is_file():  # checkpoint_format="full": memory-mapped, so only the weights' pages are read
        weights = load_pickled(path, weights_only=None, mmap=True).get("state_dict")
        if weights is None:
            raise CheckpointError(f"{path} is a file without a 'state_dict': not a Cuboid or Lightning checkpoint.")
        return {key: (t.to(dtype) if dtype else t) for key, t in weights.items()}
    reader = dcp_reader(path)
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len("model.") :]: (t.to(dtype) if dtype else t) for key, t in state.items()}


def _read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's non-tensor entries (Lightning's and Cuboid's: ``meta["cuboid"]``), without its tensors."""
    path = to_path(path)
    check_loadable(path, allow_file=True)
    if path.is_file():
        return {k: v for k, v in load_pickled(path, weights_only=None, mmap=True).items() if k != "state_dict"}
    return load_pickled(path / META_FILE, weights_only=None)


def _export_peft(path: Path, weights: dict[str, torch.Tensor], prefix: str, out: Path, hf: bool) -> list[Path]:
    configs = _read_meta(path).get("cuboid", {}).get("adapters", {})
    model = prefix.rstrip(".")
    if model not in configs:
        found = ", ".join(repr(k) for k in configs) or "none"
        raise SystemExit(
            f"cuboid.export --peft: {path} holds no PEFT adapters under {model!r} (adapters found under: {found}). "
            "It was not saved from a model wrapped with peft.get_peft_model, or set --prefix to where that model "
            "sits in the LightningModule."
        )
    own = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if not hf:
        return write_peft_adapters(own, configs[model], out)
    # an adapter of the reference Llama, for the Hugging Face LlamaForCausalLM its base was loaded from
    written: list[Path] = []
    for adapter, config in configs[model].items():
        tensors, config = to_hf_llama_adapter(peft_state_dict(own, adapter), config)
        named = {name.replace(".lora_A.", f".lora_A.{adapter}.").replace(".lora_B.", f".lora_B.{adapter}."): t
                 for name, t in tensors.items()}  # fmt: skip
        written += write_peft_adapters(named, {adapter: config}, out)
    return written


if __name__ == "__main__":  # `python -m cuboid.export ...` (the CLI lives in cuboid.checkpoint.export)
    from cuboid.checkpoint.export import main

    main()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m cuboid.export CKPT OUT.safetensors [--dtype bf16] [--hf SIZE]``"""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m cuboid.export",
        description="Write a Cuboid checkpoint's model weights (sharded directory or full file, any training layout) "
        "to one safetensors file, or a Hugging Face Llama directory with --hf.",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory (sharded) or file (full)")
    parser.add_argument("out", help="the .safetensors file to write (a directory with --hf)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: as stored")
    parser.add_argument(
        "--hf",
        metavar="CONFIG",
        default=None,
        help="write a Hugging Face LlamaForCausalLM directory (OUT/model.safetensors + config.json) for the reference "
        "Llama; CONFIG is a named size (debug, 150m, 1b, 8b, 70b) or a conf/model YAML file",
    )
    parser.add_argument(
        "--config",
        metavar="CONFIG_JSON",
        default=None,
        help="the checkpoint holds a transformers model: write OUT as its Hugging Face directory (OUT/model.safetensors "
        "under the model's own names, the prefix removed, + this config.json, or the one in this directory), which "
        "AutoModelForCausalLM.from_pretrained(OUT) loads",
    )
    parser.add_argument(
        "--peft",
        action="store_true",
        help="the checkpoint holds a PEFT (LoRA) fine-tune: write OUT as PEFT's adapter directory "
        "(adapter_model.safetensors + adapter_config.json), which PeftModel.from_pretrained(base_model, OUT) loads; "
        "with --hf SIZE, the reference Llama's adapter renamed for the Hugging Face LlamaForCausalLM",
    )
    parser.add_argument(
        "--prefix", default="model.", help="where the model sits in the LightningModule (default: model.)"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:  # the form earlier releases documented: `... export CKPT OUT`
        argv = argv[1:]
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or "")
    try:
        weights = read_model_weights(args.checkpoint, dtype)
    except CheckpointError as err:
        raise SystemExit(f"cuboid.export: {err}") from None
    from safetensors.torch import save_file

    if args.peft:
        written = _export_peft(to_path(args.checkpoint), weights, args.prefix, Path(args.out), args.hf is not None)
        print(f"wrote {', '.join(str(p) for p in written)}")
        return
    if args.hf is not None or args.config is not None:  # a directory: the weights under the model's own names
        config_file = None
        if args.config is not None:
            config_file = Path(args.config)
            config_file = config_file / "config.json" if config_file.is_dir() else config_file
            if not config_file.is_file():
                raise SystemExit(f"cuboid.export: --config {args.config}: no config.json there.")
        weights = {k[len(args.prefix) :]: v for k, v in weights.items() if k.startswith(args.prefix)}
        if not weights:
            raise SystemExit(f"cuboid.export: no weights under the prefix {args.prefix!r}; set --prefix.")
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        if config_file is not None:
            (out_dir / "config.json").write_text(config_file.read_text())
        else:
            import json

            weights, config = to_hf_llama(weights, llama_shape(args.hf))
            (out_dir / "config.json").write_text(
                json.dumps({**config, "torch_dtype": str(next(iter(weights.values())).dtype)[6:]}, indent=1)
            )
        args.out = str(out_dir / "model.safetensors")
    save_file({k: v.contiguous() for k, v in weights.items()}, args.out, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({total / 2**20:.1f} MiB) to {args.out}")
