"""Suite fsdp_tp (the default of ``scripts/bench.py``): Cuboid vs Lightning's own ModelParallelStrategy on the same model and dp x tp layout.

A benchmark, not a test: it prints a table and writes JSON. Like for like: Cuboid sharded over the data-parallel
ranks (``data_parallel_shard="auto"``, FSDP2 as ModelParallelStrategy applies it) against Lightning's strategy, and
Cuboid's default beside them (it replicates a model that fits, so it holds whole parameters and optimizer state:
more bytes per rank by design). All three run in the same launch, alternating, so machine noise hits them alike. For each, it reports tokens/s (global
tokens per optimizer step / median step time, warm-up steps dropped) and per-rank bytes of
parameters + gradients + optimizer state against the ideal total / (dp_shard x tp).

    python scripts/bench.py                      # dp2 x tp1 on 2 CPU processes
    python scripts/bench.py --tp 2 --devices 4   # dp2 x tp2
    python scripts/bench.py --accelerator gpu --devices 8 --tp 2 --model 1b --seq 2048

Lightning's strategy needs the model parallelized by hand in ``configure_model``; the bench
does that the torchtitan way (same TP plan, ``fully_shard`` per block then the root).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import worker_or_relaunch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from cuboid import CuboidStrategy
from cuboid.models import CONFIGS, TP_PLAN_NO_SP, Llama, LlamaConfig

BENCH_CFG = LlamaConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=512)


class RandomTokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class LM(L.LightningModule):
    def __init__(self, cfg: LlamaConfig, by_hand: bool) -> None:
        super().__init__()
        self.cfg, self.by_hand = cfg, by_hand
        self.model = Llama(cfg)

    def configure_model(self) -> None:
        if not self.by_hand:
            return  # Cuboid parallelizes from the model's plan
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        from cuboid.parallel.plans import to_parallel_style

        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            plan = {}
            for pattern, style in TP_PLAN_NO_SP.items():  # (loss parallel needs its context in backward)
                for name, _ in self.model.named_modules():
                    if __import__("fnmatch").fnmatchcase(name, pattern):
                        plan[name] = to_parallel_style(style)
            parallelize_module(self.model, tp_mesh, plan)
        for block in self.model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.bytes = 0
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.times.append(time.perf_counter() - self._t0)
        if batch_idx == 0:
            opt = trainer.optimizers[0]

            def nbytes(t: torch.Tensor) -> int:
                t = t.to_local() if isinstance(t, DTensor) else t
                return t.numel() * t.element_size()

            ps = list(pl_module.parameters())
            self.bytes = (
                sum(nbytes(p) for p in ps)
                + sum(nbytes(p.grad) for p in ps if p.grad is not None)
                + sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
            )

    @staticmethod
    def _sync(module) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize()


def run_once(args: argparse.Namespace, which: str, cfg: LlamaConfig) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    dp = world // args.tp
    if which == "cuboid":  # the default: it replicates a model that fits (DDP's all-reduce), as Cuboid chooses
        strategy = CuboidStrategy(tensor_parallel=args.tp, timeout=timedelta(minutes=5))
    elif (
        which == "cuboid_sharded"
    ):  # FSDP2 over the data-parallel ranks, as ModelParallelStrategy shards: like for like
        strategy = CuboidStrategy(tensor_parallel=args.tp, data_parallel_shard="auto", timeout=timedelta(minutes=5))
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.tp)
    timer = StepTimer()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=world,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    module = LM(cfg, by_hand=which == "lightning")
    loader = DataLoader(RandomTokens(args.steps * args.batch * dp, args.seq, cfg.vocab_size), batch_size=args.batch)
    trainer.fit(module, loader)
    step = statistics.median(timer.times[args.warmup :])
    bytes_max = torch.tensor(float(timer.bytes))
    dist.all_reduce(bytes_max, op=dist.ReduceOp.MAX)
    return {"step_s": step, "tokens_per_s": args.batch * dp * args.seq / step, "bytes_per_rank": int(bytes_max)}


def worker(args: argparse.Namespace) -> None:
    cfg = CONFIGS[args.model] if args.model != "bench" else BENCH_CFG
    total_params = cfg.num_params()
    rows: dict[str, list[dict]] = {"cuboid_sharded": [], "lightning": [], "cuboid": []}
    for _ in range(args.rounds):
        for which in rows:
            rows[which].append(run_once(args, which, cfg))
    if dist.get_rank() == 0:
        world = int(os.environ["WORLD_SIZE"])
        bytes_per_param = 16 if args.precision != "bf16-true" else 8  # fp32 p+g+2 Adam moments
        ideal = bytes_per_param * total_params / world
        summary = {
            which: {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "step_s": statistics.median(r["step_s"] for r in rs),
                "bytes_per_rank": rs[-1]["bytes_per_rank"],
                "bytes_vs_ideal": rs[-1]["bytes_per_rank"] / ideal,
                "rounds": rs,
            }
            for which, rs in rows.items()
        }
        # like for like: Cuboid sharded as Lightning's strategy shards; the default (replicated where it fits) beside
        summary["ratio_tokens_per_s"] = summary["cuboid_sharded"]["tokens_per_s"] / summary["lightning"]["tokens_per_s"]
        summary["ratio_default_tokens_per_s"] = summary["cuboid"]["tokens_per_s"] / summary["lightning"]["tokens_per_s"]
        summary["config"] = {**vars(args), "world": world, "params": total_params, "ideal_bytes_per_rank": ideal}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
        print(
            f"\nlayout dp{world // args.tp} x tp{args.tp}, {args.model} ({total_params / 1e6:.1f}M params), "
            f"seq {args.seq}, batch {args.batch}/rank, {args.precision}, {args.accelerator}"
        )
        print(f"{'strategy':15s} {'tokens/s':>10s} {'step ms':>9s} {'MB/rank':>9s} {'vs ideal':>9s}")
        for which in rows:
            s = summary[which]
            print(
                f"{which:15s} {s['tokens_per_s']:10.0f} {1000 * s['step_s']:9.1f} "
                f"{s['bytes_per_rank'] / 2**20:9.2f} {s['bytes_vs_ideal']:9.3f}"
            )
        print(f"tokens/s ratio, sharded like for like (cuboid_sharded / lightning): {summary['ratio_tokens_per_s']:.3f}; "
              f"the default beside it (cuboid / lightning): {summary['ratio_default_tokens_per_s']:.3f}   "
              f"(JSON: {args.out})")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument(
        "--model", default="bench", help="'bench' (5M, CPU-sized) or a named size: " + ", ".join(CONFIGS)
    )
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", default="bench_results/fsdp_tp.json")
    worker_or_relaunch(__file__, parser, worker, argv)


if __name__ == "__main__":
    main()
