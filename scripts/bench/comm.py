"""Communication per optimizer step, measured by the ledger against the analytic figure, for each layout.

    python scripts/bench.py --suite comm              # every layout (2, 4 and 8 processes), then the table
    python scripts/bench.py --suite comm --world 2    # only the 2-process layouts

A benchmark, not a test. The main job's ``cuboid.models.CausalLM`` on a small Llama (fp32, gloo) trains
``--steps`` steps with :class:`cuboid.measure.CommLedger`; the last step's table, per pp rank, is set beside
:func:`cuboid.planning.expected` (FSDP, HSDP, TP and PP terms), with the ratio measured / expected for each mesh
dimension and collective kind. Collectives outside the model (gradient-norm and logging all-reduces, Cuboid's
per-step agreement) are listed as "other". The "moe-" layouts train 4 experts per block, top-2, at expert_parallel=2:
their ``ep`` row is the mean over the ranks (each rank's share follows the routing). Writes ``docs/bench/comm.json``.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from launch import launch_per_world, per_world_parser, write_results
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.measure import CommLedger
from cuboid.models import CausalLM, LlamaConfig
from cuboid.planning import expected
from cuboid.planning.estimate import Setup, Shape

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
# The "moe-" layouts train the same Llama with 4 experts of width 64 per block, top-2 (cuboid.models.moe).
MOE_CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64,
                      n_experts=4, top_k=2, moe_ffn_dim=64)  # fmt: skip
BATCH, SEQ = 8, 32
LAYOUTS: dict[int, list[tuple[str, dict]]] = {
    2: [("dp2", {}), ("tp2", {"tensor_parallel": 2}), ("pp2", {"pipeline_parallel": 2}),
        ("moe-ep2", {"expert_parallel": 2}), ("cp2", {"context_parallel": 2})],
    4: [("dp4", {}), ("dp2xtp2", {"tensor_parallel": 2}), ("hsdp2x2", {"data_parallel_replicate": 2}),
        ("pp2xdp2", {"pipeline_parallel": 2}), ("moe-ep2-in-dp4", {"expert_parallel": 2}),
        ("cp2xtp2", {"context_parallel": 2, "tensor_parallel": 2})],
    8: [("pp2xdp2xtp2", {"pipeline_parallel": 2, "tensor_parallel": 2})],
}  # fmt: skip
MODEL_DIMS = ("dp_shard", "dp_replicate", "tp", "pp", "efsdp", "ep", "cp", "dp_shard_cp")


def setup_of(kwargs: dict, world: int) -> Setup:
    pp, rep, tp, cp = (
        kwargs.get("pipeline_parallel", 1),
        kwargs.get("data_parallel_replicate", 1),
        kwargs.get("tensor_parallel", 1),
        kwargs.get("context_parallel", 1),
    )
    return Setup(pp=pp, dp_replicate=rep, dp_shard=world // (pp * rep * tp * cp), cp=cp, tp=tp, batch=BATCH, seq=SEQ,
                 precision="32-true", ep=kwargs.get("expert_parallel", 1),
                 balance=bool(MOE_CFG.aux_loss_coef) and kwargs.get("expert_parallel", 1) > 1)  # fmt: skip


def config_of(name: str) -> LlamaConfig:
    return MOE_CFG if name.startswith("moe-") else CFG


def run_layout(name: str, kwargs: dict, world: int, steps: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    ledger = CommLedger(log=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=CuboidStrategy(timeout=timedelta(seconds=120),
                        **kwargs), max_steps=steps, log_every_n_steps=steps + 1, gradient_clip_val=1.0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[ledger])  # fmt: skip
    setup = setup_of(kwargs, world)
    dp = setup.dp_replicate * setup.dp_shard
    tokens = torch.randint(0, CFG.vocab_size, (BATCH * steps * dp, SEQ + 1), generator=torch.Generator().manual_seed(0))
    model = CausalLM(model=config_of(name), warmup_steps=1, max_steps=steps)
    trainer.fit(model, DataLoader(tokens, batch_size=BATCH))
    return ledger.steps[-1]


def mean_over(steps: list[dict], dim: str) -> dict[str, list[float]]:
    """One dimension's [count, bytes] per kind, averaged over ranks (the all-to-all's share of each rank depends on
    the routing; their mean is the analytic figure)."""
    kinds = {kind for step in steps for kind in step.get(dim, {})}
    return {k: [sum(s.get(dim, {}).get(k, [0, 0])[i] for s in steps) / len(steps) for i in (0, 1)] for k in kinds}


def compare(measured: dict, setup: Setup, pp_rank: int, cfg: LlamaConfig = CFG) -> list[dict[str, Any]]:
    want = expected(Shape.of(cfg), setup, pp_rank, backend="gloo")
    rows = []
    for dim in sorted(set(measured) | set(want)):
        for kind in sorted(set(measured.get(dim, {})) | set(want.get(dim, {}))):
            count, got = measured.get(dim, {}).get(kind, [0, 0])
            exp = want.get(dim, {}).get(kind)
            rows.append({"dim": dim if dim in MODEL_DIMS else f"{dim} (other)", "kind": kind, "count": count,
                         "measured": got, "expected": exp, "ratio": got / exp if exp else None})  # fmt: skip
    return rows


def worker(args: argparse.Namespace) -> None:
    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ["WORLD_SIZE"])
    results = []
    for name, kwargs in LAYOUTS[world]:
        if args.only and name not in args.only.split(","):
            continue
        step = run_layout(name, kwargs, world, args.steps)
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, step)
        setup = setup_of(kwargs, world)
        stages = {r * world // setup.pp: r for r in range(setup.pp)}  # the first rank of each pp stage
        per_stage = {}
        for rank, stage in stages.items():
            measured = dict(per_rank[rank])
            if "ep" in measured:  # every rank of the stage, averaged
                measured["ep"] = mean_over(per_rank[rank : rank + world // setup.pp], "ep")
            per_stage[f"pp rank {stage}"] = compare(measured, setup, stage, config_of(name))
        results.append({"layout": name, "world": world, "per_stage": per_stage})
    if dist.get_rank() == 0:
        Path(args.part).write_text(json.dumps(results))


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'layout':<14}{'stage':<11}{'dimension':<22}{'kind':<16}{'count':>6}{'measured KiB':>14}"
             f"{'expected KiB':>14}{'ratio':>8}"]  # fmt: skip
    for r in results:
        for stage, rows in r["per_stage"].items():
            for row in rows:
                exp = "-" if row["expected"] is None else f"{row['expected'] / 1024:.1f}"
                ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
                lines.append(f"{r['layout']:<14}{stage:<11}{row['dim']:<22}{row['kind']:<16}{row['count']:>6}"
                             f"{row['measured'] / 1024:>14.1f}{exp:>14}{ratio:>8}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = per_world_parser(__doc__, "2, 4 or 8", "docs/bench/comm.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated layout names (default: every layout)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    forwarded = ["--steps", str(args.steps), *(["--only", args.only] if args.only else [])]
    results = launch_per_world(__file__, "comm", args.world or sorted(LAYOUTS), forwarded)
    print(table(results))
    write_results(args.out, {"steps": args.steps}, results)


if __name__ == "__main__":
    main()
