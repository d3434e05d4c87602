"""The planner's command line, ``python -m cuboid.layout`` (:mod:`cuboid.layout` is its door):

    python -m cuboid.layout model=8b nodes=4 gpus_per_node=8 gpu=h100
    python -m cuboid.layout model=70b nodes=1 gpus_per_node=8 gpu=h100 seq=4096
    python -m cuboid.layout model=path/to/config.json nodes=1 gpus_per_node=8 gpu=h100   # a Hugging Face decoder

lists every valid (pp, dp_replicate, dp_shard, cp, tp, ep) layout with its per-GPU memory and step time, marks what does
not fit, and recommends one (:mod:`cuboid.planning.planner`).
"""

from __future__ import annotations

import sys

from cuboid.planning.planner import plan, recommend, table, what_fits
from cuboid.planning.shapes import GPUS

USAGE = f"""usage: python -m cuboid.layout [key=value ...]

Every valid (pp, dp_replicate, dp_shard, cp, tp) layout for a model on a cluster, with per-GPU memory and step time by
formula, what fits, and a recommendation. Arguments are key=value (Hydra's style):

  model=NAME|PATH      a named size of cuboid.models (debug, moe_debug, 150m, 1b, 3b, 8b, 70b, 405b) or a Hugging
                       Face config.json (or its directory) of a Llama-family decoder, dense or mixture-of-experts
                       (Qwen3-MoE, Mixtral: expert_parallel degrees are tried too) (default 8b)
  nodes=N              nodes (default 1)
  gpus_per_node=N      GPUs per node (default 8)
  gpu=NAME             one of {", ".join(GPUS)} (default h100)
  seq=N                tokens per sequence (default 8192)
  precision=P          bf16-mixed | 32-true | bf16-true (default bf16-mixed)
  max_batch=N          the largest local batch tried (sequences per data-parallel rank)
  headroom=F           the fraction of GPU memory a layout may plan to use (default 0.9)
  compile=BOOL         torch.compile on (default false)

example: python -m cuboid.layout model=70b nodes=1 gpus_per_node=8 gpu=h100 seq=4096
"""


def main(argv: list[str] | None = None) -> None:
    """``key=value`` arguments (Hydra's style): model, nodes, gpus_per_node, gpu, seq, precision, max_batch,
    compile."""
    kwargs: dict[str, object] = {}
    types = {"nodes": int, "gpus_per_node": int, "seq": int, "max_batch": int, "headroom": float,
             "compile": lambda v: v.lower() in ("1", "true", "yes")}  # fmt: skip
    args = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help", "help") for arg in args):
        print(USAGE)
        return
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in ("model", "nodes", "gpus_per_node", "gpu", "seq", "precision", "max_batch",
                                  "headroom", "compile"):  # fmt: skip
            raise SystemExit(f"cuboid.layout: unknown argument {arg!r}; use key=value with keys model, nodes, "
                             "gpus_per_node, gpu, seq, precision, max_batch, headroom, compile.")  # fmt: skip
        kwargs[key] = types.get(key, str)(value)
    options = plan(**kwargs)  # type: ignore[arg-type]
    print(table(options))
    print(f"What fits ({kwargs.get('precision', 'bf16-mixed')}):")
    print(what_fits(options, int(kwargs.get("gpus_per_node", 8))))  # type: ignore[arg-type]
    print(recommend(options))
