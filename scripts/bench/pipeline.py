"""Pipeline bubble benchmark: measured idle fraction per stage vs theory, and a picture of one step.

    python scripts/bench.py --suite pipeline     # or: python scripts/bench/pipeline.py

Runs pp=2 (two processes; on a 2-core machine more stages would wait for a core and look like
bubble) with GPipe, 1F1B and Interleaved1F1B at M = 4, 8, 16 microbatches, on Cuboid's Llama and on an
unmodified transformers ``LlamaForCausalLM`` of the same size (``--model llama|hf_llama|both``). Busy time comes from
per-action timestamps around each stage's forward and backward of a microbatch; idle = 1 - busy /
step time, averaged over timed steps. Everything that is not a stage's compute counts as idle:
the bubble, but also send/recv waits and Cuboid's per-step bookkeeping. Theory: (P-1)/(M+P-1) for
GPipe and 1F1B; for interleaving with V stages per rank (P-1)/(V*M+P-1) (the bubble divided by
about V, Narayanan et al. 2021). Writes JSON and a PNG timeline (blue forward, green backward).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from cuboid import CuboidStrategy
from cuboid.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=512, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=256)
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class Tokens(Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.data = torch.randint(0, CFG.vocab_size, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Llama(CFG)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class HFLM(LM):
    """The same sizes as a transformers LlamaForCausalLM, trained the way its users write the step."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=CFG.vocab_size,
            hidden_size=CFG.dim,
            intermediate_size=CFG.ffn_dim,
            num_hidden_layers=CFG.n_layers,
            num_attention_heads=CFG.n_heads,
            num_key_value_heads=CFG.n_kv_heads,
            max_position_embeddings=CFG.max_seq_len + 1,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss


class ActionTimer(L.Callback):
    """Wall-clock (start, end, kind) of each stage action, and the bounds of each step."""

    def __init__(self) -> None:
        self.actions: list[tuple[float, float, str, int]] = []
        self.steps: list[tuple[float, float]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for stage in trainer.strategy.pipelining.runner.stages:
            for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
                self._wrap(stage, method, kind)

    def _wrap(self, stage, method: str, kind: str) -> None:
        original = getattr(stage, method)

        def timed(*args, **kwargs):
            start = time.time()
            out = original(*args, **kwargs)
            self.actions.append((start, time.time(), kind, stage.stage_index))
            return out

        setattr(stage, method, timed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dist.barrier()
        self._t0 = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dist.barrier()
        self.steps.append((self._t0, time.time()))


def run_one(model: str, schedule: str, microbatches: int, args: argparse.Namespace) -> dict:
    timer = ActionTimer()
    virtual = 2 if schedule == "Interleaved1F1B" else 1
    strategy = CuboidStrategy(
        pipeline_parallel=2, pipeline_schedule=schedule, microbatches=microbatches, timeout=timedelta(minutes=5)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    L.seed_everything(0, verbose=False)
    batch = microbatches * args.microbatch_size
    module = HFLM() if model == "hf_llama" else LM()
    trainer.fit(module, DataLoader(Tokens(batch * args.steps, args.seq), batch_size=batch))
    idle = []
    for start, end in timer.steps[args.warmup :]:
        busy = sum(min(e, end) - max(s, start) for s, e, _, _ in timer.actions if e > start and s < end)
        idle.append(1 - busy / (end - start))
    mine = {"idle": sum(idle) / len(idle), "step_s": sum(e - s for s, e in timer.steps[args.warmup :]) / len(idle)}
    last_start, last_end = timer.steps[-1]
    mine["timeline"] = [(s - last_start, e - last_start, k, i) for s, e, k, i in timer.actions if s >= last_start]
    mine["step_window"] = last_end - last_start
    # Each timed step's actions (both ranks share one clock): the bubble is measured within the pipeline's span,
    # from the first action of any stage to the last, as the theory counts it; the step's own bookkeeping
    # before and after the schedule (splitting the batch, handing the results out) lies outside it.
    mine["actions_per_step"] = [
        [(s, e) for s, e, _, _ in timer.actions if s >= start and e <= end] for start, end in timer.steps[args.warmup :]
    ]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    span_idle = [[] for _ in everyone]
    for step in range(len(mine["actions_per_step"])):
        acts = [r["actions_per_step"][step] for r in everyone]
        first, last = min(s for a in acts for s, _ in a), max(e for a in acts for _, e in a)
        for rank, a in enumerate(acts):
            span_idle[rank].append(1 - sum(e - s for s, e in a) / (last - first))
    p = 2
    theory = (p - 1) / (virtual * microbatches + p - 1)
    return {
        "model": model,
        "schedule": schedule,
        "microbatches": microbatches,
        "virtual": virtual,
        "theory": theory,
        "idle_per_stage": [r["idle"] for r in everyone],
        "bubble_per_stage": [sum(v) / len(v) for v in span_idle],
        "step_s": max(r["step_s"] for r in everyone),
        "timelines": [r["timeline"] for r in everyone],
        "window": max(r["step_window"] for r in everyone),
    }


def write_png(path: Path, rows: list[list[tuple[float, float, str, int]]], window: float, width: int = 900) -> None:
    """A minimal PNG (no plotting dependency): one band per pp rank, blue = forward, green = backward."""
    band, gap = 40, 10
    height = len(rows) * (band + gap) + gap
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    colours = {"F": (66, 110, 220), "B": (60, 170, 90)}
    for r, actions in enumerate(rows):
        top = gap + r * (band + gap)
        for x in range(width):
            for y in (top - 1, top + band):
                pixels[y][x] = (180, 180, 180)
        for s, e, kind, stage in actions:
            x0, x1 = (
                int(s / window * (width - 1)),
                max(int(s / window * (width - 1)) + 1, int(e / window * (width - 1))),
            )
            shade = colours[kind] if stage < 2 else tuple(int(c * 0.6) for c in colours[kind])
            for y in range(top + 2, top + band - 2):
                for x in range(max(0, x0), min(width, x1)):
                    pixels[y][x] = shade
    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    path.write_bytes(png + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def worker(args: argparse.Namespace) -> None:
    models = ("llama", "hf_llama") if args.model == "both" else (args.model,)
    results = [run_one(model, s, m, args) for model in models for s in SCHEDULES for m in (4, 8, 16)]
    if dist.get_rank() != 0:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"\npipeline bubble, pp=2, {CFG.n_layers}-block Llama (Cuboid's: llama; transformers': hf_llama), microbatch "
        f"{args.microbatch_size} x {args.seq} tokens, CPU"
    )
    print("idle: 1 - busy / step time (everything not a stage's compute); bubble: 1 - busy / the schedule's span")
    header = (
        f"{'model':9s} {'schedule':16s} {'M':>3s} {'idle s0':>8s} {'idle s1':>8s} {'bubble s0':>10s} {'bubble s1':>10s}"
    )
    print(header + f" {'theory':>7s} {'bubble/theory':>14s} {'step ms':>8s}")
    for r in results:
        ratio = sum(r["bubble_per_stage"]) / len(r["bubble_per_stage"]) / r["theory"]
        print(
            f"{r['model']:9s} {r['schedule']:16s} {r['microbatches']:3d} {r['idle_per_stage'][0]:8.3f} "
            f"{r['idle_per_stage'][1]:8.3f} {r['bubble_per_stage'][0]:10.3f} {r['bubble_per_stage'][1]:10.3f} "
            f"{r['theory']:7.3f} {ratio:14.2f} {1000 * r['step_s']:8.1f}"
        )
    for r in results:
        if r["microbatches"] == 8:
            write_png(out.with_name(f"pipeline_{r['model']}_{r['schedule']}_M8.png"), r["timelines"], r["window"])
    slim = [{k: v for k, v in r.items() if k not in ("timelines",)} for r in results]
    out.write_text(json.dumps({"config": vars(args), "results": slim}, indent=1))
    print(f"JSON: {out}; timelines: {out.parent}/pipeline_*_M8.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--model", choices=["llama", "hf_llama", "both"], default="both")
    parser.add_argument("--out", default="bench_results/pipeline.json")
    sys.path.insert(0, str(Path(__file__).parent))
    from launch import worker_or_relaunch

    worker_or_relaunch(__file__, parser, worker, argv, nprocs=2)


if __name__ == "__main__":
    main()
