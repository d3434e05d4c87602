"""Checkpoint throughput: Cuboid's sharded save/load (sync and async) vs ``torch.save`` of the same bytes.

    python scripts/bench.py --suite checkpoint [--model 150m] [--devices 2]

After one training step (so AdamW state exists), each rank times: a sync save, an async save
(time the training loop is blocked, and time until the write is complete), a load into the same
layout, the checksums' part of a save and of a load (each rank hashing the files it wrote, or stands for), and ``torch.save`` (fsynced, as DCP's writer does) / ``torch.load`` of its own local shards
(parameters + optimizer state) to one file: the plain-PyTorch floor for writing the same bytes.
Dirty pages are flushed (``os.sync``) before every timed operation, so one write does not bill
the next. MB/s are per rank, except for
``checkpoint_format="full"`` (gathered to rank 0, one file): there MB/s is of the whole file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.checkpoint.sharded import verify_checkpoint, write_checksums
from cuboid.models import CONFIGS, Llama


class LM(L.LightningModule):
    def __init__(self, size: str) -> None:
        super().__init__()
        self.model = Llama(CONFIGS[size])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def local_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {n: (p.to_local() if isinstance(p, DTensor) else p).detach() for n, p in module.named_parameters()}
    for i, state in enumerate(optimizer.state.values()):
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim():
                out[f"opt.{i}.{k}"] = v.to_local() if isinstance(v, DTensor) else v
    return out


def timed(fn) -> float:
    """Seconds for ``fn`` on every rank, starting with no dirty pages left from the previous operation."""
    os.sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def fsynced_save(obj: object, path: Path) -> None:
    """``torch.save`` flushed to disk, as DCP's writer does (``sync_files=True``), so the two compare."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def worker(args: argparse.Namespace) -> None:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    # Sharded on purpose: these figures are of DCP's sharded checkpoints, which a model small enough
    # to replicate would not write by default (its format is then one full file).
    strategy = CuboidStrategy(data_parallel_shard="auto", timeout=timedelta(minutes=10))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=world,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = LM(args.model)
    data = torch.randint(0, 256, (2 * world, 65))
    trainer.fit(module, DataLoader(data, batch_size=2))
    from launch import shared_tempdir

    root = shared_tempdir(strategy, "cuboid-bench-")
    local = local_state(module, trainer.optimizers[0])
    mb = sum(t.numel() * t.element_size() for t in local.values()) / 2**20
    result: dict[str, float] = {"mb_per_rank": mb}
    result["sync_save_s"] = timed(lambda: trainer.save_checkpoint(root / "sync.ckpt"))
    strategy.checkpointer.async_save = True
    blocked = {}
    result["async_total_s"] = timed(
        lambda: (
            blocked.__setitem__("t", timed(lambda: trainer.save_checkpoint(root / "async.ckpt"))),
            strategy.wait_for_checkpoint(),
        )
    )
    result["async_blocked_s"] = blocked["t"]
    result["load_s"] = timed(lambda: strategy.load_checkpoint(root / "sync.ckpt"))
    # What the checksums cost inside them (cuboid.checkpoint.sharded: each rank hashes its own files)
    result["checksums_write_s"] = timed(lambda: write_checksums(root / "sync.ckpt"))
    result["checksums_verify_s"] = timed(lambda: verify_checkpoint(root / "sync.ckpt"))
    strategy.checkpointer.async_save, strategy.checkpointer.format = False, "full"
    result["full_save_s"] = timed(lambda: trainer.save_checkpoint(root / "full.ckpt"))
    result["full_load_s"] = timed(lambda: strategy.load_checkpoint(root / "full.ckpt"))
    mine = root / f"torch-rank{dist.get_rank()}.pt"
    result["torch_save_s"] = timed(lambda: fsynced_save(local, mine))
    result["torch_load_s"] = timed(lambda: torch.load(mine, weights_only=True))
    if dist.get_rank() == 0:
        total = {k: mb * world if k.startswith("full") else mb for k in result}
        rate = {k[:-2] + "_mb_per_s": total[k] / v for k, v in result.items() if k.endswith("_s")}
        print(
            f"\ncheckpoint throughput, {args.model} Llama, dp{world}, {mb:.0f} MB per rank (params + AdamW), CPU disk"
        )
        print(f"{'operation':22s} {'seconds':>9s} {'MB/s':>10s}")
        keys = (
            "sync_save",
            "async_blocked",
            "async_total",
            "load",
            "torch_save",
            "torch_load",
            "full_save",
            "full_load",
        )
        for key in keys:
            print(f"{key:22s} {result[key + '_s']:9.2f} {rate[key + '_mb_per_s']:10.0f}")
        for key, whole in (("checksums_write", "sync_save"), ("checksums_verify", "load")):
            share = result[key + "_s"] / result[whole + "_s"]
            print(f"{key:22s} {result[key + '_s']:9.2f} {rate[key + '_mb_per_s']:10.0f}  ({share:.1%} of {whole})")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "seconds": result, "mb_per_s": rate}, indent=1))
        print(f"JSON: {args.out}")
        if args.append:  # one line for scripts/bench_gpu.sh's figures
            line = {"check": "checkpoint", "model": args.model, "world": world, "accelerator": args.accelerator,
                    "mb_per_rank": round(mb), "gb_per_s": {k.replace("_mb_", "_gb_"): round(v / 1024, 3) for k, v in rate.items()},
                    "ok": all(v > 0 for v in rate.values())}  # fmt: skip
            print(f"RESULT {json.dumps(line)}")
            with open(args.append, "a") as f:
                f.write(json.dumps(line) + "\n")
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="150m", choices=list(CONFIGS))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", default="bench_results/checkpoint.json")
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu (one process per device)")
    parser.add_argument("--append", default=None, help="also append one JSON line of GB/s to this file")
    sys.path.insert(0, str(Path(__file__).parent))
    from launch import worker_or_relaunch

    worker_or_relaunch(__file__, parser, worker, argv)


if __name__ == "__main__":
    main()
