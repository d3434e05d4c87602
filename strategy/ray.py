"""Cuboid under Ray Train (the ``ray`` extra): ``RayCuboidStrategy``, the Ray flavour of :class:`CuboidStrategy`.

Ray's Lightning guide builds, inside a ``TorchTrainer``'s train loop::

    trainer = L.Trainer(strategy=RayCuboidStrategy(tensor_parallel=2), plugins=[RayLightningEnvironment()],
                        callbacks=[RayTrainReportCallback()], devices="auto")
    trainer = ray.train.lightning.prepare_trainer(trainer)

Ray starts the workers and their process group; ``prepare_trainer`` accepts Ray's own strategies and their
subclasses. This flavour meets it the way Ray's ``RayDDPStrategy`` does: the world comes from Ray's train context
(not from ``devices``, which is one device per worker under Ray), the device from ``ray.train.torch.get_device()``,
and the class counts as a ``RayDDPStrategy`` (registered as its virtual subclass: Cuboid's data-parallel default is
DDP's drop-in). Everything else is Cuboid's: the layout, the data-parallel sampler over the dp ranks only (Ray's
own strategies deal over the whole world, which under tp or cp would hand peers different samples), checkpoints.
"""

from __future__ import annotations

import torch

from cuboid.parallel import LayoutError
from cuboid.strategy import CuboidStrategy

try:
    import ray.train
    import ray.train.torch
    from ray.train.lightning import RayDDPStrategy
except ImportError as err:  # pragma: no cover  (the extra not installed)
    raise ImportError(
        "cuboid.ray needs Ray Train: pip install 'cuboid[ray]' (or pip install 'ray[train]>=2.60')"
    ) from err


class RayCuboidStrategy(CuboidStrategy):
    """:class:`CuboidStrategy` in a Ray Train worker: takes every argument ``CuboidStrategy`` takes. The Trainer's
    processes are Ray's workers (``ScalingConfig(num_workers=...)``), whatever ``devices`` and ``num_nodes`` say;
    each node must run the same number of workers."""

    @property
    def root_device(self) -> torch.device:
        """This worker's device, as Ray assigned it (``ray.train.torch.get_device()``)."""
        return ray.train.torch.get_device()

    def _configure_launcher(self) -> None:
        context = ray.train.get_context()
        world, local = context.get_world_size(), context.get_local_world_size()
        if world % local:
            raise LayoutError(
                f"Ray started {world} workers with {local} on this node: CuboidStrategy needs the same number of "
                "workers on every node (its layout spans whole nodes). Give the ScalingConfig a worker count that "
                "fills each node alike (num_workers a multiple of the workers per node)."
            )
        self.parallel_devices = [ray.train.torch.get_device()] * local
        self.num_nodes = world // local
        super()._configure_launcher()


RayDDPStrategy.register(RayCuboidStrategy)  # what ray.train.lightning.prepare_trainer asks for

__all__ = ["RayCuboidStrategy"]
