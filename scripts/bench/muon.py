"""Muon across shards beside AdamW: time per step and the bytes Muon's whole matrices move.

    python scripts/bench.py --suite muon [--steps 30] [--rounds 3] [--devices 2] [--out docs/bench/muon.json]

A Llama of 4 blocks (dim 256, 8 heads, 2 KV heads, ffn 768, vocabulary 256: 3.4M parameters, 28 block matrices) on
``--devices`` CPU processes, FSDP2 over them (``data_parallel_shard="auto"``), batch 8 x 128 tokens per rank, the
same loop for every optimizer (manual optimization):

- ``adamw``: one AdamW over every parameter;
- ``muon``: torch's ``torch.optim.Muon`` (bfloat16 Newton-Schulz) for the block matrices, AdamW for the rest;
- ``muon_fp32``: ``cuboid.optim.Muon(ns_dtype=torch.float32)`` in its place.

Per run: the median milliseconds per step after 5 warm-up steps and of its optimizer steps alone, in alternating
rounds (this machine's speed drifts); and, from ``CommLedger``, the gather and scatter bytes per step on the
data-parallel mesh beside the analytic figure ``sum over matrices of n x P x b`` (``n`` ranks, ``P`` the largest
shard's elements, ``b`` = 4). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import worker_or_relaunch, write_results
from torch.utils.data import DataLoader

from cuboid import CommLedger, CuboidStrategy
from cuboid.models.llama import CONFIGS, Llama
from cuboid.optim import Muon

CFG = replace(CONFIGS["debug"], vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768,
              max_seq_len=256)  # fmt: skip
SEQ, BATCH, WARMUP = 128, 8, 5
MODES = ("adamw", "muon", "muon_fp32")


class Model(L.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Llama(CFG)
        self.model.init_weights()
        self.mode = mode
        self.automatic_optimization = False
        self.starts: list[float] = []
        self.optimizer_ms: list[float] = []

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.starts.append(time.perf_counter())
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        start = time.perf_counter()
        for opt in optimizers:
            opt.step()
        self.optimizer_ms.append((time.perf_counter() - start) * 1000)
        return loss

    def configure_optimizers(self) -> Any:
        named = dict(self.model.named_parameters())
        matrices = [n for n, p in named.items() if p.ndim == 2 and n.startswith("layers.")]
        rest = [p for n, p in named.items() if n not in matrices]
        if self.mode == "adamw":
            return torch.optim.AdamW(named.values(), lr=1e-3)
        muon = (Muon([named[n] for n in matrices], lr=0.02, ns_dtype=torch.float32) if self.mode == "muon_fp32"
                else torch.optim.Muon([named[n] for n in matrices], lr=0.02))  # fmt: skip
        return [muon, torch.optim.AdamW(rest, lr=1e-3)]


def run(mode: str, steps: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module, ledger = Model(mode), CommLedger(log=False)
    world = int(os.environ["WORLD_SIZE"])
    data = torch.randint(
        0, CFG.vocab_size, (BATCH * world * steps, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=CuboidStrategy(data_parallel_shard="auto"),
                        max_steps=steps * (1 if mode == "adamw" else 2), logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[ledger])  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    gaps = [b - a for a, b in zip(module.starts[WARMUP:], module.starts[WARMUP + 1 :], strict=False)]
    table = ledger.steps[-1].get("dp_shard", {})
    expected = 0
    if mode != "adamw":  # the block matrices' largest shards, as FSDP2 splits their rows
        for n, p in module.model.named_parameters():
            if p.ndim == 2 and n.startswith("layers."):
                expected += world * math.ceil(p.shape[0] / world) * p.shape[1] * 4
    return {"ms_per_step": statistics.median(gaps) * 1000, "optimizer_ms": statistics.median(module.optimizer_ms[WARMUP:]),
            "gather": table.get("gather", [0, 0]), "scatter": table.get("scatter", [0, 0]), "analytic": expected}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            rounds[mode].append(run(mode, args.steps))
    if dist.get_rank() != 0:
        return
    adamw = statistics.median(r["ms_per_step"] for r in rounds["adamw"])
    print(f"\n{'optimizer':10s} {'ms/step':>9s} {'vs adamw':>9s} {'optimizer ms':>13s} {'gather MB':>10s} "
          f"{'scatter MB':>11s} {'analytic MB':>12s}")  # fmt: skip
    results = []
    for mode, got in rounds.items():
        ms = statistics.median(r["ms_per_step"] for r in got)
        opt_ms = statistics.median(r["optimizer_ms"] for r in got)
        last = got[-1]
        print(f"{mode:10s} {ms:9.1f} {ms / adamw:9.3f} {opt_ms:13.1f} {last['gather'][1] / 1e6:10.3f} "
              f"{last['scatter'][1] / 1e6:11.3f} {last['analytic'] / 1e6:12.3f}")  # fmt: skip
        results.append({"optimizer": mode, "ms_per_step": round(ms, 2), "vs_adamw": round(ms / adamw, 3),
                        "optimizer_ms": round(opt_ms, 2), "gather": last["gather"], "scatter": last["scatter"],
                        "analytic_bytes": last["analytic"],
                        "rounds_ms": [round(r["ms_per_step"], 2) for r in got]})  # fmt: skip
    params = sum(p.numel() for p in Llama(CFG).parameters())
    write_results(args.out, {"steps": args.steps, "rounds": args.rounds, "world": dist.get_world_size(),
                             "parameters": params, "seq": SEQ, "batch_per_rank": BATCH}, results)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="batches per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", default="docs/bench/muon.json")
    worker_or_relaunch(__file__, parser, worker, argv)


if __name__ == "__main__":
    main()
