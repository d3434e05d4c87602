"""Cuboid's main job in a clone of the repository: the same Hydra job as ``python -m cuboid.train``.

python scripts/train.py                                          # debug model, 2 CPU processes
python scripts/train.py strategy=fsdp_tp trainer.devices=4 model=debug
python scripts/train.py -m strategy.tensor_parallel=1,2          # sweep: one process group per job
python scripts/train.py --help                                   # the config groups and every key
"""

from cuboid.train import main

if __name__ == "__main__":
    main()
