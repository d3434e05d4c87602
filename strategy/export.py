"""Weight export: ``python -m cuboid.export`` (also ``python -m cuboid.checkpoint export``).

Writes a checkpoint's model weights (sharded or full, any training layout) to one safetensors file, or,
for the reference Llama, a Hugging Face ``LlamaForCausalLM`` directory. Apart from the checkpoint core:
it is the only place that maps Cuboid's checkpoints onto a model family (``cuboid.models``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from cuboid.checkpoint import CheckpointError, read_model_weights


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m cuboid.export export CKPT OUT.safetensors [--dtype bf16] [--hf SIZE]``"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cuboid.checkpoint", description="Cuboid checkpoint tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write a sharded checkpoint's model weights to one safetensors file")
    export.add_argument("checkpoint")
    export.add_argument("out")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: as stored")
    export.add_argument(
        "--hf",
        metavar="CONFIG",
        default=None,
        help="write a Hugging Face LlamaForCausalLM directory (OUT/model.safetensors + config.json) for the reference "
        "Llama; CONFIG is a named size (debug, 150m, 1b, 8b, 70b) or a conf/model YAML file",
    )
    export.add_argument(
        "--prefix", default="model.", help="where the Llama sits in the LightningModule (default: model.)"
    )
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or "")
    try:
        weights = read_model_weights(args.checkpoint, dtype)
    except CheckpointError as err:
        raise SystemExit(f"cuboid.checkpoint: {err}") from None
    from safetensors.torch import save_file

    if args.hf is not None:
        import json

        from cuboid.models.llama import CONFIGS, LlamaConfig, to_hf_llama

        if args.hf in CONFIGS:
            cfg = CONFIGS[args.hf]
        else:
            from omegaconf import OmegaConf

            fields = OmegaConf.to_container(OmegaConf.load(args.hf))
            fields.pop("_target_", None)
            cfg = LlamaConfig(**fields)
        mine = {k[len(args.prefix) :]: v for k, v in weights.items() if k.startswith(args.prefix)}
        weights, config = to_hf_llama(mine, cfg)
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(
            json.dumps({**config, "torch_dtype": str(next(iter(weights.values())).dtype)[6:]}, indent=1)
        )
        args.out = str(out_dir / "model.safetensors")
    save_file({k: v.contiguous() for k, v in weights.items()}, args.out)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({total / 2**20:.1f} MiB) to {args.out}")


if __name__ == "__main__":
    main()
