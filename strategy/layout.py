"""The layout planner's command line, and the layout names (:class:`Layout`, :class:`LayoutError`, defined in
:mod:`cuboid.mesh`):

    python -m cuboid.layout model=8b nodes=4 gpus_per_node=8 gpu=h100
    python -m cuboid.layout model=70b nodes=1 gpus_per_node=8 gpu=h100 seq=4096
    python -m cuboid.layout model=path/to/config.json nodes=1 gpus_per_node=8 gpu=h100   # a Hugging Face decoder

lists every valid (pp, dp_replicate, dp_shard, tp) layout with its per-GPU memory and step time, marks what does
not fit, and recommends one (:mod:`cuboid.planner`). The package itself does not import this module, so running
it with ``-m`` loads it once.
"""

from __future__ import annotations

from cuboid.mesh import Layout, LayoutError

__all__ = ["Layout", "LayoutError", "main"]


def main(argv: list[str] | None = None) -> None:
    from cuboid.planner import main as plan_main

    plan_main(argv)


if __name__ == "__main__":
    main()
