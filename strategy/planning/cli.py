"""The planner's command line, ``python -m cuboid.layout`` (:mod:`cuboid.layout` is its door):

    python -m cuboid.layout model=8b nodes=4 gpus_per_node=8 gpu=h100
    python -m cuboid.layout model=70b nodes=1 gpus_per_node=8 gpu=h100 seq=4096
    python -m cuboid.layout model=path/to/config.json nodes=1 gpus_per_node=8 gpu=h100   # a Hugging Face decoder

lists every valid (pp, dp_replicate, dp_shard, cp, tp, ep) layout with its per-GPU memory and step time, marks what does
not fit, and recommends one (:mod:`cuboid.planning.planner`).

    python -m cuboid.layout --module pkg.mod:Class [--init-args JSON] [--devices N] [--nodes N] [--gpu h100]

measures any LightningModule's training step on fake tensors (one batch of its own ``train_dataloader``) and costs
every layout Cuboid can apply to it, as ``CuboidStrategy(layout="auto")`` does at setup
(:mod:`cuboid.planning.at_setup`).
"""

from __future__ import annotations

import sys

from cuboid.planning.planner import plan, recommend, table, what_fits
from cuboid.planning.shapes import GPUS

USAGE = f"""usage: python -m cuboid.layout [key=value ...]

Every valid (pp, dp_replicate, dp_shard, cp, tp) layout for a model on a cluster, with per-GPU memory and step time by
formula, what fits, and a recommendation. Arguments are key=value (Hydra's style):

  model=NAME|PATH      a named size of cuboid.models (debug, moe_debug, 150m, 1b, 3b, 8b, 70b, 405b) or a Hugging
                       Face config.json (or its directory) of a Llama-family decoder, dense or mixture-of-experts
                       (Qwen3-MoE, Mixtral: expert_parallel degrees are tried too) (default 8b)
  nodes=N              nodes (default 1)
  gpus_per_node=N      GPUs per node (default 8)
  gpu=NAME             one of {", ".join(GPUS)} (default h100)
  seq=N                tokens per sequence (default 8192)
  precision=P          bf16-mixed | 32-true | bf16-true (default bf16-mixed)
  max_batch=N          the largest local batch tried (sequences per data-parallel rank)
  headroom=F           the fraction of GPU memory a layout may plan to use (default 0.9)
  compile=BOOL         torch.compile on (default false)

example: python -m cuboid.layout model=70b nodes=1 gpus_per_node=8 gpu=h100 seq=4096

Any LightningModule, measured on fake tensors (what layout="auto" does at setup):

  python -m cuboid.layout --module pkg.mod:Class [--init-args JSON] [--devices N] [--nodes N]
                          [--gpu NAME] [--precision P] [--device-memory 80GB]

  --module           the LightningModule's class (importable), built with --init-args (a JSON object)
  --devices          GPUs per node (default 8); --nodes (default 1); --gpu one of the names above (default h100)
  --precision        the Trainer's precision (default bf16-mixed); --device-memory overrides the GPU's memory
  The batch measured is the first of the module's own train_dataloader().
"""


def main(argv: list[str] | None = None) -> None:
    """``key=value`` arguments (Hydra's style): model, nodes, gpus_per_node, gpu, seq, precision, max_batch,
    compile."""
    kwargs: dict[str, object] = {}
    types = {"nodes": int, "gpus_per_node": int, "seq": int, "max_batch": int, "headroom": float,
             "compile": lambda v: v.lower() in ("1", "true", "yes")}  # fmt: skip
    args = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help", "help") for arg in args):
        print(USAGE)
        return
    if any(arg.startswith("--module") for arg in args):
        module_main(args)
        return
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in ("model", "nodes", "gpus_per_node", "gpu", "seq", "precision", "max_batch",
                                  "headroom", "compile"):  # fmt: skip
            raise SystemExit(f"cuboid.layout: unknown argument {arg!r}; use key=value with keys model, nodes, "
                             "gpus_per_node, gpu, seq, precision, max_batch, headroom, compile.")  # fmt: skip
        kwargs[key] = types.get(key, str)(value)
    options = plan(**kwargs)  # type: ignore[arg-type]
    print(table(options))
    print(f"What fits ({kwargs.get('precision', 'bf16-mixed')}):")
    print(what_fits(options, int(kwargs.get("gpus_per_node", 8))))  # type: ignore[arg-type]
    print(recommend(options))


def module_main(args: list[str]) -> None:
    """``--module pkg.mod:Class``: measure that LightningModule and print every layout, fastest first."""
    import argparse
    import importlib
    import json
    import warnings

    from cuboid.planning.at_setup import plan_module, table
    from cuboid.planning.auto import Device
    from cuboid.planning.measured import first_batch

    parser = argparse.ArgumentParser(prog="python -m cuboid.layout", add_help=False)
    parser.add_argument("--module", required=True)
    parser.add_argument("--init-args", default="{}")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--device-memory", default=None)
    opts = parser.parse_args(args)
    where, _, name = opts.module.partition(":")
    if not name:
        raise SystemExit(f"cuboid.layout: --module {opts.module!r}: give it as package.module:ClassName.")
    try:
        cls = getattr(importlib.import_module(where), name)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"cuboid.layout: --module {opts.module!r} could not be imported: {err}") from err
    try:
        init = json.loads(opts.init_args)
    except json.JSONDecodeError as err:
        raise SystemExit(f"cuboid.layout: --init-args is not a JSON object: {err}") from err
    import lightning as L
    import torch

    from cuboid.parallel import parse_bytes

    with torch.device("meta"):  # shapes only: a 70B model measures on a laptop
        lm = cls(**init)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    lm.trainer = trainer
    with torch.device("meta"):
        lm.configure_model()
    hw = GPUS[opts.gpu]
    memory = parse_bytes(opts.device_memory) or hw.memory
    device = Device(hw.name, memory, hw.peak["bf16"], hw.nvlink, hw.network, per_node=opts.devices)
    planned = plan_module(lm, first_batch(lm.train_dataloader()), opts.devices * opts.nodes, opts.nodes, device,
                          precision=opts.precision)  # fmt: skip
    for line in planned.lines:
        print(line)
    if planned.options:
        print(table(planned.options))
