"""Fault-tolerant replica groups against plain HSDP, with no failure: what torchft's quorum, its process group and
the commit cost per step.

    python scripts/bench.py --suite replicas [--model debug] [--steps 14] [--warmup 4] [--batch 2] [--seq 128]
                                             [--tick-ms 10] [--out docs/bench/replicas.json]

The same model, global batch and data-parallel degree on 4 CPU processes (gloo), one after the other:

* ``hsdp``: one job, ``CuboidStrategy(data_parallel_replicate=2)`` (replicate 2 x shard 2);
* ``replica_groups``: a torchft lighthouse in this process and two jobs of 2 processes each,
  ``CuboidStrategy(fault_tolerance=...)`` (FSDP over each job's 2, the average over the 2 groups through torchft).

Tokens/s: global tokens per optimizer step / the median step time (warm-up steps dropped); for the groups, each
group's tokens summed. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import lightning as L
from fsdp_tp import LM, RandomTokens, StepTimer
from launch import relaunch_cmd
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.models import CONFIGS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="debug", choices=sorted(CONFIGS), help="a Llama size (default: debug)")
    p.add_argument("--steps", type=int, default=14, help="optimizer steps per run (default 14)")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the median (default 4)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step (default 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--tick-ms", type=int, default=10, help="the lighthouse's quorum tick (default 10 ms)")
    p.add_argument("--out", default="docs/bench/replicas.json", help="where the JSON goes")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("hsdp", "replica_groups"), help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    return p


def worker(args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if args.mode == "hsdp":
        strategy = CuboidStrategy(data_parallel_replicate=2, timeout=timedelta(minutes=5))
    else:
        ft = {"lighthouse": args.lighthouse, "replica_group": args.group, "groups": 2}
        strategy = CuboidStrategy(fault_tolerance=ft, timeout=timedelta(minutes=5))
    timer = StepTimer()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])  # fmt: skip
    cfg = CONFIGS[args.model]
    trainer.fit(
        LM(cfg, by_hand=False),
        DataLoader(RandomTokens(4 * args.steps * args.batch, args.seq, cfg.vocab_size), args.batch),
    )
    if trainer.global_rank == 0:
        step = statistics.median(timer.times[args.warmup :])
        Path(args.result).write_text(json.dumps({"step_s": step, "tokens_per_s": world * args.batch * args.seq / step}))


def run(args: argparse.Namespace, argv: list[str], scratch: Path) -> dict:
    """Both runs, from outside torchrun: returns {mode: {"step_s", "tokens_per_s"}}."""
    hsdp = scratch / "hsdp.json"
    subprocess.run(relaunch_cmd(__file__, 4, [*argv, "--mode", "hsdp", "--result", str(hsdp)]), check=True)
    os.environ.setdefault("RUST_LOG", "error")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=args.tick_ms)
    try:
        results = [scratch / f"group{g}.json" for g in (0, 1)]
        jobs = [subprocess.Popen(relaunch_cmd(__file__, 2, [*argv, "--mode", "replica_groups", "--group", str(g),
                                                            "--lighthouse", lighthouse.address(),
                                                            "--result", str(results[g])]))
                for g in (0, 1)]  # fmt: skip
        if any(job.wait() != 0 for job in jobs):
            sys.exit("bench replicas: a replica group failed (its output is above)")
    finally:
        lighthouse.shutdown()
    groups = [json.loads(r.read_text()) for r in results]
    return {
        "hsdp": json.loads(hsdp.read_text()),
        "replica_groups": {"step_s": max(g["step_s"] for g in groups),
                           "tokens_per_s": sum(g["tokens_per_s"] for g in groups)},
    }  # fmt: skip


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="cuboid-bench-replicas-") as scratch:
        rows = run(args, argv, Path(scratch))
    ratio = rows["replica_groups"]["tokens_per_s"] / rows["hsdp"]["tokens_per_s"]
    print(
        f"\nreplica groups against HSDP, {args.model} Llama, 4 CPU processes (gloo), batch {args.batch} x seq {args.seq}"
    )
    print(f"{'mode':16s} {'tokens/s':>10s} {'step ms':>9s}")
    for mode, row in rows.items():
        print(f"{mode:16s} {row['tokens_per_s']:10.0f} {1000 * row['step_s']:9.1f}")
    print(f"tokens/s ratio replica_groups / hsdp: {ratio:.3f}   (JSON: {args.out})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows, "ratio_tokens_per_s": ratio}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
