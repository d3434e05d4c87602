"""Cuboid's Hydra configuration tree, shipped as package data (``pkg://cuboid.conf``).

Importing it (Hydra does, to read the tree) registers the ``cuboid.gpus_per_node`` resolver that the SLURM launcher
config uses, so that a sweep on a CPU cluster (``trainer.accelerator=cpu``) asks SLURM for no GPU without an edit.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


def gpus_per_node(accelerator: Any, devices: Any) -> int | None:
    """``--gpus-per-node`` for a job of ``devices`` tasks per node on ``accelerator``: the task count on GPUs, none
    (``None``: the option is left out) on CPUs or when the count is not a number (``devices: auto``)."""
    if str(accelerator).lower() == "cpu" or not str(devices).isdigit():
        return None
    return int(devices)


OmegaConf.register_new_resolver("cuboid.gpus_per_node", gpus_per_node, replace=True)
