"""One-GPU checks and figures, run by ``scripts/bench_gpu.sh`` (each subcommand is one PASS/FAIL line there).

    python scripts/bench/gpu.py throughput --model 1b --seq 2048 --batch 4 [--compile] [--ac selective]
    python scripts/bench/gpu.py resume --model 150m [--async-save]     # save at an epoch end, resume, compare
    python scripts/bench/gpu.py offload --model 150m                   # cpu_offload + meta init + clipping

Each prints one JSON line (prefixed ``RESULT``) and exits non-zero when its check fails. Every run builds the
model on the meta device (``CausalLM(meta_init=True)``), trains with ``CuboidStrategy`` in bf16-mixed (the
default here) on one process. ``--accelerator cpu --model debug`` runs the same logic on a CPU, for trying the
script itself (no MFU: no known peak).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.callbacks import device_peak_flops, peak_memory_bytes
from cuboid.models import CausalLM


def tokens(n: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))


class StepClock(L.Callback):
    """Wall time of the steps after ``warmup`` (synchronized once at each end: a benchmark may wait)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.t0, self.t1, self.steps = warmup, 0.0, 0.0, 0

    def _sync(self, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.warmup:
            self._sync(module)
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self._sync(module)
            self.t1, self.steps = time.perf_counter(), trainer.global_step - self.warmup


class Losses(L.Callback):
    """Every step's logged loss (the run logs every step)."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        value = trainer.callback_metrics.get("train/loss")
        if value is not None:
            self.by_step[trainer.global_step] = float(value)


def trainer_for(args: argparse.Namespace, strategy: CuboidStrategy, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": args.accelerator,
        "devices": 1,
        "precision": args.precision,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    module = CausalLM(model=args.model, meta_init=True, warmup_steps=2, max_steps=args.steps)
    clock = StepClock(args.warmup)
    strategy = CuboidStrategy(compile=args.compile, activation_checkpointing=args.ac)
    trainer = trainer_for(args, strategy, max_steps=args.steps, callbacks=[clock], log_every_n_steps=args.steps)
    data = tokens(args.batch * args.steps, args.seq, module.cfg.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    step_s = (clock.t1 - clock.t0) / max(1, clock.steps)
    tokens_per_s = args.batch * args.seq / step_s
    flops_per_s = module.flops_per_token(args.seq) * tokens_per_s
    peak = device_peak_flops(module.device, args.precision)
    return {
        "check": "throughput",
        "model": args.model,
        "params": sum(p.numel() for p in module.parameters()),
        "matmul_params": module.cfg.matmul_params(),
        "seq": args.seq,
        "batch": args.batch,
        "compile": args.compile,
        "ac": args.ac,
        "precision": args.precision,
        "step_ms": round(step_s * 1000, 2),
        "tokens_per_s": round(tokens_per_s),
        "mfu": None if peak is None else round(flops_per_s / peak, 4),
        "peak_mem_gib": round(peak_memory_bytes(module.device) / 2**30, 2),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "ok": math.isfinite(step_s) and clock.steps > 0,
    }


def resume(args: argparse.Namespace) -> dict[str, Any]:
    """Two epochs straight; then one epoch, a checkpoint at its end, and a resume for the second: the second
    epoch's losses must match (same data order: no shuffling)."""
    per_epoch = 5
    batches = args.batch * per_epoch
    vocab = CausalLM(model=args.model).cfg.vocab_size
    loader = DataLoader(tokens(batches, args.seq, vocab), batch_size=args.batch)

    def run(epochs: int, ckpt_dir: Path | None, ckpt_path: str | None) -> Losses:
        L.seed_everything(0, verbose=False)
        module = CausalLM(model=args.model, meta_init=True, warmup_steps=2, max_steps=2 * per_epoch)
        losses = Losses()
        callbacks: list[L.Callback] = [losses]
        if ckpt_dir is not None:
            callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1))
        strategy = CuboidStrategy(async_checkpoint=args.async_save)
        trainer = trainer_for(
            args, strategy, max_epochs=epochs, callbacks=callbacks, log_every_n_steps=1,
            enable_checkpointing=ckpt_dir is not None,
        )  # fmt: skip
        started = time.perf_counter()
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        losses.seconds = time.perf_counter() - started  # type: ignore[attr-defined]
        return losses

    with tempfile.TemporaryDirectory() as tmp:
        straight = run(2, None, None)
        first = run(1, Path(tmp), None)
        saved = sorted(Path(tmp).glob("*.ckpt"))
        second = run(2, None, str(saved[-1])) if saved else Losses()
    steps = range(per_epoch + 1, 2 * per_epoch + 1)
    diffs = [abs(second.by_step[s] - straight.by_step[s]) for s in steps if s in second.by_step]
    return {
        "check": "resume",
        "model": args.model,
        "async_save": args.async_save,
        "checkpoint": saved[-1].name if saved else None,
        "first_epoch_s": round(first.seconds, 2),  # type: ignore[attr-defined]
        "losses_straight": [round(straight.by_step[s], 4) for s in steps],
        "losses_resumed": [round(second.by_step.get(s, float("nan")), 4) for s in steps],
        "max_abs_diff": max(diffs) if diffs else None,
        # bf16-mixed on a GPU is not bitwise deterministic (atomics in attention's backward): a loose bound.
        "ok": bool(saved) and len(diffs) == per_epoch and max(diffs) < 2e-2,
    }


def offload(args: argparse.Namespace) -> dict[str, Any]:
    """cpu_offload=True with meta init and gradient clipping: shards live on the host, steps run on the GPU."""
    module = CausalLM(model=args.model, meta_init=True, warmup_steps=2, max_steps=args.steps)
    losses = Losses()
    strategy = CuboidStrategy(cpu_offload=args.accelerator != "cpu")
    trainer = trainer_for(
        args, strategy, max_steps=args.steps, callbacks=[losses], log_every_n_steps=1, gradient_clip_val=1.0
    )
    data = tokens(args.batch * args.steps, args.seq, module.cfg.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    devices = sorted({str(p.device) for p in module.parameters()})
    values = [losses.by_step[s] for s in sorted(losses.by_step)]
    return {
        "check": "offload",
        "model": args.model,
        "parameter_devices": devices,
        "losses": [round(v, 4) for v in values],
        "peak_mem_gib": round(peak_memory_bytes(module.device) / 2**30, 2),
        # (random tokens: the loss need not fall in a few steps) the shards stay on the host under offload
        "ok": len(values) == args.steps
        and all(math.isfinite(v) for v in values)
        and (args.accelerator == "cpu" or devices == ["cpu"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["throughput", "resume", "offload"])
    parser.add_argument("--model", default="150m")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--ac", choices=["full", "selective"], default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--out", default=None, help="append the result as one JSON line to this file")
    args = parser.parse_args(argv)
    result = {"throughput": throughput, "resume": resume, "offload": offload}[args.check](args)
    result["date"] = time.strftime("%Y-%m-%d")
    result["torch"] = torch.__version__
    line = json.dumps(result)
    print(f"RESULT {line}", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
