"""``python -m cuboid.dryrun``: a layout parallelized on meta over fake ranks (:mod:`cuboid.planning.dryrun`)."""

from cuboid.planning.dryrun import dry_run, main

__all__ = ["dry_run", "main"]

if __name__ == "__main__":
    main()
