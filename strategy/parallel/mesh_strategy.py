"""The Lightning side of a device mesh: :class:`MeshStrategy`, a ``ParallelStrategy`` whose processes form one
named ``DeviceMesh``. It owns the mesh, the data-parallel group that samplers, logged values and metrics use, and
the collectives Lightning asks a strategy for. :class:`cuboid.CuboidStrategy` builds on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from cuboid import compat
from cuboid.parallel.mesh import Layout, build_device_mesh, build_ep_meshes, dim_groups
from cuboid.parallel.parallelize import ExpertsLayout
from cuboid.step.precision import CuboidPrecision

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision


class MeshCollectives:
    """What a strategy on one device mesh answers, the Trainer's (:class:`MeshStrategy`) and Fabric's
    (:class:`cuboid.fabric.CuboidStrategy`) alike: the mesh, its flattened data-parallel sub-mesh ``"dp"`` (data is
    split over ``dp`` only), the sampler's arguments, and barrier, broadcast and decisions over every rank.
    Subclasses set ``_device_mesh``, ``_dp_mesh`` and ``_process_group_backend`` in ``setup_environment``."""

    _device_mesh: DeviceMesh | None = None
    _dp_mesh: DeviceMesh | None = None
    _process_group_backend: str | None = None
    parallel_devices: list[torch.device] | None
    local_rank: int

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh ``("pp", "dp_replicate", "dp_shard", "tp")``."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have started (setup_environment).")
        return self._device_mesh

    def token_groups(self) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """(name, group) of the mesh dims whose ranks hold different tokens of a step: the data-parallel dims, and
        cp (its ranks hold different parts of the same sequences)."""
        return dim_groups(self.device_mesh, ("dp_replicate", "dp_shard")), dim_groups(self.device_mesh, ("cp",))

    @property
    def experts_layout(self) -> Any:
        """Under ``expert_parallel > 1``, the :class:`~cuboid.parallel.parallelize.ExpertsLayout` (the ``ep`` mesh
        the experts are split over, the mesh their FSDP shards over); ``None`` otherwise."""
        return getattr(self, "_experts", None)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Process group of the data-parallel ranks (replicas x shards) that share this rank's tp/pp
        coordinates. Pass it to torchmetrics (``Metric(process_group=strategy.dp_group)``) so
        tensor-parallel peers, which see the same batch, are not counted twice."""
        return self.dp_mesh.get_group()

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel ranks (dp_replicate x dp_shard flattened) as a 1-D mesh named ``"dp"``."""
        if self._dp_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have started (setup_environment).")
        return self._dp_mesh

    def build_mesh(self, layout: Layout) -> None:
        """Once the process group exists: the layout's device mesh, its ``dp`` sub-mesh, and under expert parallel
        the meshes each MoE layer's experts are split and sharded over."""
        self.layout = layout
        self._device_mesh, self._dp_mesh = build_device_mesh(layout, self.mesh_root_device().type)
        if layout.ep > 1:
            self._experts = ExpertsLayout(*build_ep_meshes(self._device_mesh, layout.ep), layout.dp * layout.cp)

    def mesh_root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    def dp_sampler_kwargs(self) -> dict[str, Any]:
        """A sampler's split over the data-parallel ranks only: tp, cp and pp peers get the same batch."""
        return {"num_replicas": self.dp_mesh.size(), "rank": self.dp_mesh.get_local_rank()}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def barrier_all(self) -> None:
        if not compat.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce_over_dp(self, tensor: Any, group: Any | None, reduce_op: ReduceOp | str | None) -> Any:
        """All-reduce ``tensor`` over ``group``, by default the data-parallel group (tp and pp peers and cp ranks
        hold the same values and must not be counted again); anything but a tensor is returned as is."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._device_mesh is not None:
            group = self.dp_group
        return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def decide_over_all(self, decision: bool, all: bool = True) -> bool:
        """A decision agreed over every rank: all of them (``all``) or any."""
        if not compat.distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN if all else dist.ReduceOp.MAX)
        return bool(flag.item())


class MeshStrategy(MeshCollectives, ParallelStrategy):
    """The Trainer's ``ParallelStrategy`` on one device mesh: ``reduce`` (``self.log(sync_dist=True)``) averages
    over ``dp``; the precision plugin is always a :class:`~cuboid.step.precision.CuboidPrecision`."""

    @property
    @override
    def precision_plugin(self) -> CuboidPrecision:
        if not isinstance(self._precision_plugin, CuboidPrecision):
            self._precision_plugin = CuboidPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning hands a third-party strategy an autocast/casting plugin; keep its precision name only.
        if plugin is None or isinstance(plugin, CuboidPrecision):
            self._precision_plugin = plugin
        else:
            self._precision_plugin = CuboidPrecision(str(plugin.precision))

    @property
    @override
    def root_device(self) -> torch.device:
        return self.mesh_root_device()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Split data over the data-parallel ranks only: tp (and pp) peers get the same batch."""
        return self.dp_sampler_kwargs()

    @override
    def barrier(self, name: str | None = None) -> None:
        self.barrier_all()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce over the data-parallel group by default (what ``self.log(sync_dist=True)`` uses)."""
        return self.reduce_over_dp(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree on a decision over *every* rank (ModelCheckpoint's top-k, EarlyStopping, ...). Lightning's default
        sums the flag over :meth:`reduce`'s data-parallel group and compares it with the world size: under tp or
        pp the two never match."""
        return self.decide_over_all(decision, all)
