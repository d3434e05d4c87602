"""Balancing Cuboid's debug MoE: the load-balancing loss against the experts' bias, step by step.

    python scripts/bench.py --suite balance [--steps 300] [--rate 1e-3] [--devices 2] [--out docs/bench/balance.json]

Cuboid's ``moe_debug`` Llama (4 layers of 4 experts, top 2, a shared expert) on ``--devices`` CPU processes (FSDP2
over them), on the same tokens (sequences drawn from one fixed random bigram table, so there is something to
learn and the routers specialise), trained four ways from the same initial weights:

- ``aux``: the Switch load-balancing loss at moe_debug's weight (``aux_loss_coef=0.01``), no bias;
- ``bias``: no loss (``aux_loss_coef=0``), ``CuboidStrategy(expert_bias_rate=RATE)``;
- ``bias+aux``: both (DeepSeek-V3 keeps a small loss beside the bias);
- ``none``: neither.

Each step's load imbalance is the figure ``CuboidMonitor`` logs, ``moe/load_imbalance``: the largest max / mean
tokens per expert of any layer (1.0 is balanced), the tokens counted over every rank (``cuboid.experts.ExpertLoad``,
forwards only). Prints a table (the mean over the first and the last fifth of the steps, the final language-model
loss without the auxiliary term) and writes JSON, and an SVG of each run's imbalance (a 10-step running mean) beside
it.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import worker_or_relaunch, write_results
from torch.utils.data import DataLoader, Dataset

from cuboid import CuboidStrategy
from cuboid.experts import ExpertLoad
from cuboid.models.llama import CONFIGS, Llama

RUNS = {"aux": (0.01, False), "bias": (0.0, True), "bias+aux": (0.01, True), "none": (0.0, False)}
SEQ, BATCH = 64, 8  # per rank


class Bigrams(Dataset):
    """Sequences of a fixed random bigram table (each token has a few likely successors)."""

    def __init__(self, n: int, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        table = torch.softmax(torch.randn(vocab, vocab, generator=g) * 3, dim=-1)
        start = torch.randint(0, vocab, (n,), generator=g)
        tokens = [start]
        for _ in range(SEQ):
            tokens.append(torch.multinomial(table[tokens[-1]], 1, generator=g).squeeze(1))
        self.tokens = torch.stack(tokens, dim=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class MoELM(L.LightningModule):
    def __init__(self, aux_loss_coef: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Llama(replace(CONFIGS["moe_debug"], aux_loss_coef=aux_loss_coef))
        self.model.init_weights()
        self.imbalance: list[float] = []
        self.lm_losses: list[float] = []
        self.load: ExpertLoad | None = None

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        lm = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        self.lm_losses.append(float(lm.detach()))
        aux = self.model.aux_loss()
        return lm if aux is None or not self.model.cfg.aux_loss_coef else lm + self.model.cfg.aux_loss_coef * aux

    def on_train_start(self) -> None:
        self.load = ExpertLoad(self)

    def on_train_batch_start(self, *args: Any) -> None:
        self.load.on = True

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.load.on = False

    def on_train_batch_end(self, *args: Any) -> None:
        figures = self.load.take([self.trainer.strategy.dp_group])
        self.imbalance.append(figures["moe/load_imbalance"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def run(name: str, steps: int, rate: float) -> dict[str, Any]:
    coef, biased = RUNS[name]
    L.seed_everything(0, verbose=False)
    module = MoELM(coef)
    strategy = CuboidStrategy(data_parallel_shard="auto", expert_bias_rate=rate if biased else None)
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(module, DataLoader(Bigrams(BATCH * world * steps), batch_size=BATCH))
    lm = torch.tensor(module.lm_losses[-10:])
    if dist.is_initialized():
        dist.all_reduce(lm)
        lm /= dist.get_world_size()
    return {"imbalance": module.imbalance, "lm_loss_last10": float(lm.mean())}


def svg(series: dict[str, list[float]], path: Path, window: int = 10) -> None:
    """Each run's imbalance, a ``window``-step running mean, as one polyline (no plotting library needed)."""
    width, height, pad = 640, 320, 40
    smooth = {
        k: [statistics.fmean(v[max(0, i - window + 1) : i + 1]) for i in range(len(v))] for k, v in series.items()
    }
    top = max(max(v) for v in smooth.values())
    steps = max(len(v) for v in smooth.values())
    colours = {"aux": "#1f77b4", "bias": "#d62728", "bias+aux": "#2ca02c", "none": "#7f7f7f"}

    def xy(i: int, y: float) -> str:
        return f"{pad + i * (width - 2 * pad) / max(1, steps - 1):.1f},{height - pad - (y - 1) / (top - 1) * (height - 2 * pad):.1f}"

    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">optimizer step (0 to {steps - 1})</text>',
             f'<text x="{pad - 4}" y="{height - pad}" text-anchor="end">1.0</text>',
             f'<text x="{pad - 4}" y="{pad + 4}" text-anchor="end">{top:.2f}</text>',
             f'<text x="{width / 2}" y="20" text-anchor="middle">moe/load_imbalance (max / mean tokens per expert, worst layer), {window}-step mean</text>']  # fmt: skip
    for n, (name, values) in enumerate(smooth.items()):
        points = " ".join(xy(i, y) for i, y in enumerate(values))
        lines.append(f'<polyline fill="none" stroke="{colours[name]}" stroke-width="1.5" points="{points}"/>')
        lines.append(f'<text x="{width - pad - 70}" y="{pad + 16 * n}" fill="{colours[name]}">{name}</text>')
    path.write_text("\n".join([*lines, "</svg>"]) + "\n")


def worker(args: argparse.Namespace) -> None:
    got = {name: run(name, args.steps, args.rate) for name in RUNS}
    if dist.get_rank() != 0:
        return
    fifth = max(1, args.steps // 5)
    results = []
    print(f"\n{'run':10s} {'imbalance, first fifth':>24s} {'last fifth':>12s} {'LM loss (last 10)':>18s}")
    for name, r in got.items():
        first, last = statistics.fmean(r["imbalance"][:fifth]), statistics.fmean(r["imbalance"][-fifth:])
        print(f"{name:10s} {first:24.3f} {last:12.3f} {r['lm_loss_last10']:18.4f}")
        results.append({"run": name, "aux_loss_coef": RUNS[name][0], "expert_bias_rate": args.rate if RUNS[name][1] else None,
                        "imbalance_first_fifth": round(first, 4), "imbalance_last_fifth": round(last, 4),
                        "lm_loss_last10": round(r["lm_loss_last10"], 4),
                        "imbalance": [round(v, 4) for v in r["imbalance"]]})  # fmt: skip
    write_results(args.out, {"steps": args.steps, "rate": args.rate, "world": dist.get_world_size(),
                             "seq": SEQ, "batch_per_rank": BATCH}, results)  # fmt: skip
    svg({name: r["imbalance"] for name, r in got.items()}, Path(args.out).with_suffix(".svg"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rate", type=float, default=1e-3, help="expert_bias_rate of the bias runs")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", default="docs/bench/balance.json")
    worker_or_relaunch(__file__, parser, worker, argv)


if __name__ == "__main__":
    main()
