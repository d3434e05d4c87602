"""Peak host memory (RSS) of each rank while CuboidStrategy sets a model up, against the model's fp32 bytes.

    python scripts/setup_memory.py --model 1b --meta         # built on meta: rank 0 initialises piece by piece
    python scripts/setup_memory.py --model 1b                # built for real on every rank, then sharded
    python scripts/setup_memory.py --model 1b --meta --pretrained DIR   # filled from a Hugging Face directory

Runs ``--devices`` CPU processes (FSDP over all of them) through Lightning's own launcher, stops right after
setup (the model sharded and filled, the optimizer made, no step), and prints one JSON line: each rank's RSS
before setup, its peak during setup (``ru_maxrss``), and the model's fp32 bytes. ``--model`` takes a named size
or a JSON dict of LlamaConfig fields. ``--json PATH`` also appends the line to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.models import CausalLM
from cuboid.models.llama import CONFIGS, LlamaConfig


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StopAfterSetup(L.Callback):
    """Records RSS before setup and the peak through it (the fit runs no step)."""

    def __init__(self) -> None:
        self.before = 0
        self.result: dict[str, int] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.before = rss_bytes()
        self.start = time.perf_counter()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        seconds = int((time.perf_counter() - self.start) * 1000)
        mine = torch.tensor([self.before, peak, rss_bytes(), seconds], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(trainer.world_size)]
        torch.distributed.all_gather(everyone, mine)
        self.result = {"ranks": [t.tolist() for t in everyone]}

    def on_train_batch_start(self, *args: object) -> None:
        raise AssertionError("setup_memory trains no step (limit_train_batches=0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--meta", action="store_true", help="build on the meta device (CausalLM(meta_init=True))")
    parser.add_argument("--pretrained", default=None, help="fill the model from this weights path")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = args.model if args.model in CONFIGS else json.loads(args.model)
    cfg = CONFIGS[model] if isinstance(model, str) else LlamaConfig(**model)
    task = CausalLM(model=model, meta_init=args.meta)
    strategy = CuboidStrategy(**({"pretrained": {"model": args.pretrained}} if args.pretrained else {}))
    stop = StopAfterSetup()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        limit_train_batches=0,  # setup, then no step
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[stop],
    )
    data = DataLoader(torch.zeros(8, 9, dtype=torch.long), batch_size=1)
    trainer.fit(task, data)
    if trainer.global_rank == 0:
        gib = 2**30
        model_bytes = cfg.num_params() * 4
        ranks = stop.result["ranks"]
        line = {
            "label": args.label,
            "model": args.model,
            "meta_init": args.meta,
            "pretrained": bool(args.pretrained),
            "devices": args.devices,
            "model_fp32_gib": round(model_bytes / gib, 2),
            "rank0_before_gib": round(ranks[0][0] / gib, 2),
            "rank0_peak_gib": round(ranks[0][1] / gib, 2),
            "rank0_peak_over_model": round((ranks[0][1] - ranks[0][0]) / model_bytes, 2),
            "peak_gib_per_rank": [round(r[1] / gib, 2) for r in ranks],
            "setup_s": round(max(r[3] for r in ranks) / 1000, 1),
        }
        print(json.dumps(line))
        if args.json:
            with Path(args.json).open("a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
