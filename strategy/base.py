"""What the two doors share: :class:`MeshCollectives`, the one build behind the Trainer's strategy
(:class:`cuboid.CuboidStrategy`) and Fabric's (:class:`cuboid.fabric.CuboidStrategy`), and :class:`MeshStrategy`, the
Trainer's ``ParallelStrategy`` on it.

One build: the arguments both doors take arrive as one checked record, :class:`~cuboid.parallel.BuildSettings`
(:meth:`MeshCollectives.init_build`); the processes, the process group and the meshes start one way
(:meth:`MeshCollectives.start_mesh`), and the model is parallelized with one set of settings
(:meth:`MeshCollectives.parallel_settings`). The degrees, resolved, live in :class:`~cuboid.parallel.ParallelDims`.
Each door keeps only its own framework's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from cuboid import compat
from cuboid.checkpoint import load_pretrained, plan_pretrained
from cuboid.context import ContextParallel
from cuboid.dropin import Replicating
from cuboid.experts import ExpertBias, LoadBalancing
from cuboid.job import start_process_group
from cuboid.parallel import (
    BuildSettings,
    Layout,
    ParallelDims,
    ParallelSettings,
    finish_weights,
    parallelize_plain,
    prepare_weights,
    submesh,
)
from cuboid.step import CuboidPrecision, DeferredReductions, refuse_muon_shapes, whole_matrix_steps

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision

P = TypeVar("P")


def own_precision(plugin: Any, kind: Callable[..., P]) -> P | None:
    """The door's own precision plugin for what Lightning or Fabric hands a third-party strategy (an autocast or
    casting plugin): its precision name is kept, in ``kind``; ``None`` and ``kind`` instances pass as they are."""
    if plugin is None or isinstance(plugin, kind):  # type: ignore[arg-type]
        return plugin
    return kind(str(plugin.precision))


class MeshCollectives:
    """What a strategy on one device mesh answers, the Trainer's (:class:`MeshStrategy`) and Fabric's
    (:class:`cuboid.fabric.CuboidStrategy`) alike: the build's settings, the mesh (from :attr:`dims`), its flattened
    data-parallel sub-mesh ``"dp"`` (data is split over ``dp`` only), the sampler's arguments, and barrier, broadcast
    and decisions over every rank."""

    settings: BuildSettings
    dims: ParallelDims
    _process_group_backend: str | None = None
    parallel_devices: list[torch.device] | None
    local_rank: int
    # After setup: how many pieces of a meta-built model rank 0 initialised ("initialized") and how many tensors
    # built for real it sent ("sent"); both 0 when a checkpoint about to be loaded fills every weight.
    weights_made: dict[str, int] = {}  # noqa: RUF012  (replaced, never changed in place)
    # A model built on the meta device in configure_model is given storage and initialised here, shard by shard
    # (what cuboid.models.CausalLM(meta_init=None) asks a strategy).
    materializes_meta = True

    def init_build(self, settings: BuildSettings) -> None:
        """Keep the door's checked record (:attr:`settings`), the degrees in :attr:`dims`, and make what the
        settings ask of each step: deferred reductions, context parallel, the experts' load balancing."""
        self.settings = settings
        layout = settings.layout
        self.dims = ParallelDims(layout)
        self.deferred = DeferredReductions(
            settings.defer_reductions, hsdp=layout.dp_replicate > 1, pipelined=layout.pp > 1
        )
        self.context = ContextParallel(self.dims, settings.compile, settings.activation_checkpointing)
        self.load_balancing = LoadBalancing(settings.load_balancing)
        self.expert_bias = ExpertBias(settings.expert_bias_rate)
        self._process_group_backend = settings.process_group_backend  # resolved by the device at start

    @property
    def layout(self) -> Layout:
        """The degrees (resolved once the processes have started)."""
        return self.dims.layout

    def start_mesh(
        self, before_group: Callable[[str], None] | None = None, after_group: Callable[[], None] | None = None
    ) -> Layout:
        """In each process: the seed, the ranks, the layout resolved against the world size, the process group
        (``before_group(backend)`` and ``after_group()`` around it) and the meshes. Returns the resolved layout."""
        reset_seed()
        self.set_world_ranks()
        layout = self.dims.resolve(self.world_size)  # type: ignore[attr-defined]
        device = self.mesh_root_device()
        backend = self._process_group_backend or compat.default_process_group_backend(device)
        self._process_group_backend = backend
        if before_group is not None:
            before_group(backend)
        timeout = self.settings.timeout
        start_process_group(self.cluster_environment, backend, device, timeout)  # type: ignore[attr-defined]
        if after_group is not None:
            after_group()
        self.dims.build(device.type)
        if device.type != "cpu":  # DTensor's RNG tracker, made here on every rank (not lazily, by some stages only)
            compat.start_dtensor_rng(self.device_mesh)
        return layout

    @property
    def initializes_locally(self) -> bool:
        """Whether each rank initializes its own shards of a meta-built model on its device (``weights_init``:
        ``"local"``, or ``"auto"`` on an accelerator without CPU offload) instead of receiving rank 0's."""
        if self.settings.weights_init == "auto":
            return self.root_device.type != "cpu" and not self.settings.cpu_offload  # type: ignore[attr-defined]
        return self.settings.weights_init == "local"

    def parallel_settings(self, mp_policy: Any) -> ParallelSettings:
        """How each block is parallelized (tp, activation checkpointing, compile, FSDP2, the experts' split)."""
        return ParallelSettings.on(self.device_mesh, self.settings, mp_policy, self.dims.experts)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``."""
        return self.dims.mesh

    def token_groups(self) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """(name, group) of the mesh dims whose ranks hold different tokens of a step: the data-parallel dims, and
        cp (its ranks hold different parts of the same sequences)."""
        return self.dims.token_groups()

    @property
    def experts_layout(self) -> Any:
        """Under ``expert_parallel > 1``, the :class:`~cuboid.parallel.mesh.ExpertsLayout` (the ``ep`` mesh
        the experts are split over, the mesh their FSDP shards over); ``None`` otherwise."""
        return self.dims.experts

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Process group of the data-parallel ranks (replicas x shards) that share this rank's tp/pp
        coordinates. Pass it to torchmetrics (``Metric(process_group=strategy.dp_group)``) so
        tensor-parallel peers, which see the same batch, are not counted twice."""
        return self.dims.dp_group

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel ranks (dp_replicate x dp_shard flattened) as a 1-D mesh named ``"dp"``."""
        return self.dims.dp_mesh

    # ------------------------------------------------------------------ the model, built the same way by both doors
    def fill_parallelized_by_user(self, root: nn.Module, module: nn.Module, pretrained: Mapping[str, str]) -> None:
        """A model the user parallelized by hand (``module``, under ``root``, whose names ``pretrained`` uses): its
        pretrained sources checked, its meta tensors materialized, then filled."""
        sources = plan_pretrained(root, pretrained)
        compat.materialize_distributed_module(module, self.root_device)
        for source in sources:
            load_pretrained(root, source)

    def prepare_build(
        self,
        root: nn.Module,
        mp_policy: Any,
        pretrained: Mapping[str, str],
        restored: set[str] = frozenset(),  # type: ignore[assignment]
        pipelined: bool = False,
    ) -> tuple[Any, ParallelSettings]:
        """A build's first half: ``root``'s weights prepared (a meta model initialised by its own init; under pp,
        with ``pipelined``, rank 0's values kept whole until the split; ``restored``: the names a checkpoint about
        to be loaded fills, left uninitialised), and the settings each parallelization takes. Returns both; the
        weights go to :meth:`finish_build` once the route chosen has parallelized the model."""
        self.expert_bias.check(root)  # a model with no router it can bias: refused before anything is built
        local = self.initializes_locally
        weights = prepare_weights(
            root, pretrained, self.root_device, pipelined=pipelined, restored=restored, local=local
        )
        return weights, self.parallel_settings(mp_policy)

    def finish_build(self, root: nn.Module, weights: Any, blocks: list[tuple[str, nn.Module]]) -> None:
        """A build's last half: the weights :meth:`prepare_build` prepared filled shard by shard. ``weights_made``
        then says how many pieces rank 0 initialised and how many real tensors it sent."""
        dp_mesh = submesh(self.device_mesh, "dp")
        offload = self.settings.cpu_offload
        finish_weights(root, weights, blocks, self.root_device, dp_mesh, offload, self.device_mesh)
        self.weights_made = dict(weights.made)

    def build_model(
        self,
        root: nn.Module,
        blocks: list[tuple[str, nn.Module]],
        matched: dict[str, Any],
        mp_policy: Any,
        pretrained: Mapping[str, str],
        restored: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> None:
        """Parallelize ``root`` whole, in place (the plain route, both doors'): :meth:`prepare_build`, then tp,
        activation checkpointing, compile and FSDP2 per block, then :meth:`finish_build`. The pipelined route is
        the Trainer strategy's: it calls the same halves around the pipeline's stage build."""
        weights, settings = self.prepare_build(root, mp_policy, pretrained, restored)
        parallelize_plain(root, blocks, matched, settings)
        self.finish_build(root, weights, blocks)

    def hook_step(
        self, module: nn.Module, blocks: list[tuple[str, nn.Module]], runner: Any = None, root: nn.Module | None = None
    ) -> None:
        """Context parallel's and the load-balancing loss's hooks on the built model (``runner``: the pipeline's,
        which cuts the schedule's inputs; ``root``: the module set up, where it is the model itself)."""
        if self.context.enabled:
            self.context.setup(module, [name for name, _ in blocks], self.device_mesh["cp"].get_group(), runner, root)
        whole_step = runner is None
        self.load_balancing.setup(
            module, blocks, *self.token_groups(), whole_step, self.context.step_padding, root=root
        )
        present = {id(m) for m in module.modules()}  # under pp: this rank's stages' blocks (the others are gone)
        self.expert_bias.setup(
            [(n, b) for n, b in blocks if id(b) in present], self.token_groups()[0], self.root_device
        )

    def describe_build(self, blocks: list[tuple[str, nn.Module]], matched: dict[str, Any], more: str = "") -> None:
        rank_zero_info(
            f"Cuboid: {len(blocks)} blocks ({blocks[0][0] if blocks else 'none found'} ...), tp plan on "
            f"{len(matched)} modules, activation checkpointing={self.settings.activation_checkpointing}{more}"
        )

    # ------------------------------------------------------------------ what Lightning and Fabric ask a strategy
    def mesh_root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def root_device(self) -> torch.device:
        return self.mesh_root_device()

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """A sampler's split over the data-parallel ranks only: tp, cp and pp peers get the same batch. With
        fault-tolerant replica groups, over every group's data-parallel ranks."""
        size, rank = self.dp_mesh.size(), self.dp_mesh.get_local_rank()
        replicas = getattr(self, "replicas", None)
        return replicas.sampler_kwargs(size, rank) if replicas is not None else {"num_replicas": size, "rank": rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:  # type: ignore[attr-defined]
            rank = self.node_rank * self.num_processes + self.local_rank  # type: ignore[attr-defined]
            self.cluster_environment.set_global_rank(rank)  # type: ignore[attr-defined]
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)  # type: ignore[attr-defined]
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not compat.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
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
        if group is None and self.dims.built:
            group = self.dp_group
        return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """A decision agreed over *every* rank (ModelCheckpoint's top-k, EarlyStopping, ...): all of them (``all``)
        or any. Lightning's default sums the flag over :meth:`reduce`'s data-parallel group and compares it with the
        world size: under tp or pp the two never match."""
        if not compat.distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN if all else dist.ReduceOp.MAX)
        return bool(flag.item())


class MeshStrategy(Replicating, MeshCollectives, ParallelStrategy):
    """The Trainer's ``ParallelStrategy`` on one device mesh: ``reduce`` (``self.log(sync_dist=True)``) averages
    over ``dp``; the precision plugin is always a :class:`~cuboid.step.precision.CuboidPrecision`."""

    def _device_capacity(self) -> float | None:
        """Bytes setup's fit checks hold a rank to: the GPU's memory; None on CPU and under CPU offload (a test
        stands in a device of its size here: tests/workers/parity_worker.py's ``DeviceOfSize``)."""
        from cuboid.measure import device_bytes

        return device_bytes(self.root_device, self.settings.cpu_offload)

    @property
    @override
    def precision_plugin(self) -> CuboidPrecision:
        if not isinstance(self._precision_plugin, CuboidPrecision):
            self._precision_plugin = CuboidPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = own_precision(plugin, CuboidPrecision)

    def __getstate__(self) -> dict[str, Any]:
        """As Lightning's strategies pickle (its optimizer wrappers left out), and on every rank, before or after a
        fit: the launcher, which holds the running job's child processes, is left out too (the next Trainer makes
        its own); the process groups are left out by the collaborators holding them."""
        state = super().__getstate__()
        state["_launcher"] = None
        return state

    def make_optimizers(self, trainer: Any) -> None:
        """Lightning's ``setup_optimizers``, with torch's Muon refusal of a parameter that is not a matrix naming the
        parameters, and the experts' bias following the routers' optimizer."""
        try:
            self.setup_optimizers(trainer)
        except ValueError as error:
            raise refuse_muon_shapes(error, self.lightning_module.named_parameters()) from error
        self.expert_bias.watch(self.optimizers)  # the bias moves after the routers' optimizer steps

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's, with torch's Muon orthogonalizing whole matrices (:mod:`cuboid.step.muon`)."""
        with whole_matrix_steps():
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.settings.cpu_offload:  # under cpu_offload the shards stay in host memory
            self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Entered by Lightning on the batches that only accumulate gradients: the reductions ``defer_reductions``
        names wait for the optimizer step's last one (:mod:`cuboid.step.accumulation`); DDP's ``no_sync``."""
        with self.deferred.accumulating(self.model, super().block_backward_sync):
            yield

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce over the data-parallel group by default (what ``self.log(sync_dist=True)`` uses)."""
        return self.reduce_over_dp(tensor, group, reduce_op)
