"""The one record of a run's layout: :class:`ParallelDims` holds the degrees (a :class:`~cuboid.parallel.mesh.Layout`),
resolves them against the world size, builds the meshes from them and answers the questions the rest of Cuboid asks
("which ranks read different data?"). Context parallel, the pipeline, the expert wiring and both doors
read their degrees here and keep none of their own (torchtitan's ``ParallelDims`` is the pattern).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cuboid.parallel.mesh import Layout, build_device_mesh, build_ep_meshes, dim_groups
from cuboid.parallel.parallelize import ExpertsLayout


class ParallelDims:
    """A run's degrees and, once the processes exist, its meshes.

    Made with the degrees as asked (``dp_shard`` may be ``"auto"``); :meth:`resolve` fills ``"auto"`` from the world
    size (or raises :class:`~cuboid.parallel.mesh.LayoutError`, naming the sizes and the fix) and :meth:`build` makes
    the device mesh, its data-parallel view and, under expert parallel, the experts' meshes."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._mesh: DeviceMesh | None = None
        self._dp_mesh: DeviceMesh | None = None
        self.experts: ExpertsLayout | None = None  # under ep > 1: the meshes each MoE layer's experts use

    # ------------------------------------------------------------------ degrees (read by Pipelining and ContextParallel)
    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    def resolve(self, world_size: int) -> Layout:
        """Fill ``"auto"`` from ``world_size`` and keep the result; raise ``LayoutError`` for sizes that cannot
        work."""
        self.layout = self.layout.resolve(world_size)
        return self.layout

    # ------------------------------------------------------------------ meshes (once the process group exists)
    def build(self, device_type: str) -> None:
        """The resolved layout's device mesh, its ``dp`` view and, under ``ep > 1``, the experts' meshes."""
        layout = self.layout
        self._mesh, self._dp_mesh = build_device_mesh(layout, device_type)
        if layout.ep > 1:
            self.experts = ExpertsLayout(*build_ep_meshes(self._mesh, layout.ep), layout.dp * layout.cp)

    @property
    def built(self) -> bool:
        return self._mesh is not None

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``."""
        if self._mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have started (setup_environment).")
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel ranks (dp_replicate x dp_shard flattened) as a 1-D mesh named ``"dp"``."""
        if self._dp_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have started (setup_environment).")
        return self._dp_mesh

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks that read different batches and share this rank's pp, cp and tp coordinates."""
        return self.dp_mesh.get_group()

    def token_groups(self) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """(name, group) of the ranks that hold different tokens of a step, as one group (``dp_cp``: data parallel
        x cp, one collective for a sum over all of them), and of cp alone (its ranks hold different parts of the
        same sequences)."""
        return dim_groups(self.mesh, ("dp_cp",)), dim_groups(self.mesh, ("cp",))
