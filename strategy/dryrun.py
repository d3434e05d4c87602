"""``python -m cuboid.dryrun``: a layout parallelized on meta over fake ranks (:mod:`cuboid.planning.dryrun`)."""

from cuboid.planning import dry_run
from cuboid.planning import dry_run_main as main

__all__ = ["dry_run", "main"]

if __name__ == "__main__":
    main()
