"""``python -m cuboid.train``: the main job (:func:`cuboid.train.main`)."""

from cuboid.train import main

main()
