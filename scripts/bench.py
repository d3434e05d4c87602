"""The benchmarks: ``python scripts/bench.py --suite NAME [options]``. Each suite prints a table and writes JSON.

    python scripts/bench.py                         # fsdp_tp: Cuboid vs ModelParallelStrategy, dp2 on 2 CPU processes
    python scripts/bench.py --tp 2 --devices 4      # fsdp_tp at dp2 x tp2
    python scripts/bench.py --suite pipeline        # pipeline bubble per schedule, against the schedule's theory
    python scripts/bench.py --suite checkpoint      # save/load MB/s, sync and async
    python scripts/bench.py --suite overhead        # host syncs and collectives per step
    python scripts/bench.py --suite comm            # the ledger's bytes per mesh dimension vs the analytic figure
    python scripts/bench.py --suite memory          # per-rank persistent and peak bytes at N = 1, 2, 4, 8
    python scripts/bench.py --suite resume          # a resume's set-up time, with and without the weights' init
    python scripts/bench.py --suite replicas        # fault-tolerant replica groups against HSDP, tokens/s
    python scripts/bench.py --suite ddp             # a DDP project's time per step: DDP, Cuboid's default, FSDP2
    python scripts/bench.py --suite balance         # an MoE's load imbalance: the load-balancing loss vs the bias
    python scripts/bench.py --suite muon            # Muon across shards beside AdamW: ms per step, bytes moved
    python scripts/bench.py --suite NAME --help     # a suite's own options

The suites live in ``scripts/bench/`` (one module each, the shared launcher in ``scripts/bench/launch.py``);
``scripts/bench_gpu.sh`` runs the one-GPU checks of ``scripts/bench/gpu.py``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SUITES = (
    "fsdp_tp",
    "pipeline",
    "checkpoint",
    "overhead",
    "comm",
    "memory",
    "resume",
    "replicas",
    "ddp",
    "balance",
    "muon",
)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    suite = "fsdp_tp"
    if "--suite" in args:
        at = args.index("--suite")
        if at + 1 >= len(args):
            sys.exit(f"bench: --suite needs a name: one of {', '.join(SUITES)}")
        suite, args = args[at + 1], args[:at] + args[at + 2 :]
    elif args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if suite not in SUITES:
        sys.exit(f"bench: unknown --suite {suite!r}; choose {', '.join(SUITES)} (fsdp_tp is the default)")
    sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
    importlib.import_module(suite).main(args)


if __name__ == "__main__":
    main()
