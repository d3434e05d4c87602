"""Resume set-up: the time from ``fit(ckpt_path=...)`` to the first step, with and without the weights' init.

    python scripts/bench.py --suite resume [--model 150m] [--devices 2] [--out FILE]

One short run of ``CausalLM`` (built on the meta device) saves a sharded checkpoint after one step; then, twice,
a fresh Trainer resumes from it and times set-up plus restore (from the ``setup`` hook to ``on_train_start``):

* ``initialize_then_load``: what Cuboid did before (and does when the checkpoint's path cannot be told): rank 0
  initializes every block and sends it out, then the checkpoint overwrites it all;
* ``load_only``: a checkpoint about to be loaded fills every weight, so nothing is initialized or sent first.

Prints a table (seconds, blocks initialized, tensors sent) and writes JSON. The times are this machine's, on
CPU with gloo: the saving grows with the model and with the distance between rank 0 and the others.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from launch import SetupClock, shared_tempdir, worker_or_relaunch
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.models import CONFIGS, CausalLM

MODES = ("initialize_then_load", "load_only")


def _trainer(world: int, max_steps: int, callbacks: list[L.Callback]) -> tuple[L.Trainer, CuboidStrategy]:
    # Sharded on purpose: these figures are of DCP's sharded checkpoints, which a model small enough
    # to replicate would not write by default (its format is then one full file).
    strategy = CuboidStrategy(data_parallel_shard="auto", timeout=timedelta(minutes=10))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    return trainer, strategy


def worker(args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    data = DataLoader(torch.randint(0, 256, (4 * world, 33), generator=torch.Generator().manual_seed(0)), batch_size=2)
    trainer, strategy = _trainer(world, 1, [])
    trainer.fit(CausalLM(model=args.model, meta_init=True, warmup_steps=1, max_steps=4), data)
    root = shared_tempdir(strategy, "cuboid-bench-resume-")
    trainer.save_checkpoint(root / "step1.ckpt")
    rows = []
    for mode in MODES:
        clock = SetupClock()
        trainer, strategy = _trainer(world, 2, [clock])
        if mode == "initialize_then_load":  # as before: the coming checkpoint is not looked for
            strategy._restored = lambda trainer, lm: set()  # type: ignore[method-assign]
        module = CausalLM(model=args.model, meta_init=True, warmup_steps=1, max_steps=4)
        trainer.fit(module, data, ckpt_path=str(root / "step1.ckpt"))
        seconds = torch.tensor([clock.seconds])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        rows.append({"mode": mode, "setup_s": float(seconds), **strategy.weights_made})
    if dist.get_rank() == 0:
        params = CONFIGS[args.model].num_params()
        print(f"\nresume set-up, {args.model} Llama built on meta, dp{world} on CPU (gloo): fit(ckpt_path) to step")
        print(f"{'mode':22s} {'seconds':>8s} {'blocks initialized':>19s} {'tensors sent':>13s}")
        for row in rows:
            print(f"{row['mode']:22s} {row['setup_s']:8.2f} {row['initialized']:19d} {row['sent']:13d}")
        saved = rows[0]["setup_s"] - rows[1]["setup_s"]
        print(f"saved: {saved:.2f} s ({saved / rows[0]['setup_s']:.0%} of the set-up)")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "params": params, "results": rows}, indent=1))
        print(f"JSON: {args.out}")
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="150m", choices=list(CONFIGS))
    parser.add_argument("--devices", type=int, default=2, help="processes (dp)")
    parser.add_argument("--out", default="/tmp/cuboid-resume.json")
    worker_or_relaunch(__file__, parser, worker, argv)


if __name__ == "__main__":
    main()
