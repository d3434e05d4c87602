"""``python -m cuboid.layout``: the layout planner's command line (:mod:`cuboid.planning.cli`)."""

from cuboid.parallel import Layout, LayoutError
from cuboid.planning import planner_main as main

__all__ = ["Layout", "LayoutError", "main"]

if __name__ == "__main__":
    main()
