"""A DDP project switched to Cuboid: time per step against Lightning's DDP, in one launch.

    python scripts/bench.py --suite ddp [--rounds 4] [--steps 60] [--out docs/bench/ddp.json]

Two models a DDP project trains, neither an LLM: the template-style dense network (784 -> 64 -> 128 -> 64 -> 10 with
BatchNorm, Adam, batch 64) and a small recurrent one (a 2-layer LSTM over 20 steps of 16 features, batch 64). On 2
CPU processes (one torchrun launch, gloo), each model trains under ``strategy="ddp"`` and under Cuboid's default
(``CuboidStrategy()``: it replicates a model that fits, as DDP does) and, for the record, Cuboid with
``data_parallel_shard="auto"`` (FSDP2), in alternating rounds (this machine's speed drifts by 2x from hour to
hour: interleaving keeps the comparison fair). Each run's time per step is the median of its steps after 10 warm-up
steps; each cell the median over rounds. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import worker_or_relaunch, write_results
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cuboid import CuboidStrategy

MODES = ("ddp", "cuboid", "cuboid_sharded")


class Project(L.LightningModule):
    def __init__(self, model: str) -> None:
        super().__init__()
        self.recurrent = model == "recurrent"
        if self.recurrent:
            self.net = nn.LSTM(16, 64, num_layers=2, batch_first=True)
            self.head = nn.Linear(64, 10)
        else:
            self.net = nn.Sequential(
                nn.Linear(784, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
                nn.Linear(128, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10),
            )  # fmt: skip
        self.starts: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recurrent:
            out, _ = self.net(x)
            return self.head(out[:, -1])
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run(model: str, mode: str, steps: int) -> float:
    """Milliseconds per step (the median after 10 warm-up steps) of one fit."""
    L.seed_everything(0, verbose=False)
    module = Project(model)
    strategy: Any = {"ddp": "ddp", "cuboid": CuboidStrategy(),
                     "cuboid_sharded": CuboidStrategy(data_parallel_shard="auto")}[mode]  # fmt: skip
    shape = (20, 16) if model == "recurrent" else (784,)
    g = torch.Generator().manual_seed(0)
    world = int(os.environ["WORLD_SIZE"])  # (the process group is made by the first Trainer)
    n = 64 * (steps + 1) * world
    data = TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=64))
    gaps = [b - a for a, b in zip(module.starts[10:], module.starts[11:], strict=False)]
    return statistics.median(gaps) * 1000


def worker(args: argparse.Namespace) -> None:
    times: dict[str, dict[str, list[float]]] = {m: {mode: [] for mode in MODES} for m in ("dense", "recurrent")}
    for _ in range(args.rounds):
        for model in times:
            for mode in MODES:
                times[model][mode].append(run(model, mode, args.steps))
    if dist.get_rank() != 0:
        return
    results = []
    print(f"\n{'model':10s} {'strategy':16s} {'ms/step (median of rounds)':>28s} {'vs ddp':>8s}   rounds")
    for model, by_mode in times.items():
        ddp = statistics.median(by_mode["ddp"])
        for mode, ms in by_mode.items():
            median = statistics.median(ms)
            print(f"{model:10s} {mode:16s} {median:28.2f} {median / ddp:8.3f}   {', '.join(f'{t:.2f}' for t in ms)}")
            results.append({"model": model, "strategy": mode, "ms_per_step": round(median, 3),
                            "vs_ddp": round(median / ddp, 3), "rounds": [round(t, 3) for t in ms]})  # fmt: skip
    write_results(args.out, {"rounds": args.rounds, "steps": args.steps, "world": dist.get_world_size()}, results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", default="docs/bench/ddp.json")
    worker_or_relaunch(__file__, parser, worker, argv)


if __name__ == "__main__":
    main()
