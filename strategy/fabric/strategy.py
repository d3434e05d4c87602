"""Lightning Fabric's door: :class:`CuboidStrategy` for ``Fabric(strategy=...)``, on the same mesh as the Trainer's.

A Fabric loop has no ``training_step`` for Cuboid to wrap: the user calls the model, computes a loss, calls
``fabric.backward``, clips and steps. So the strategy works through what Fabric hands it: ``setup_module`` builds the
model exactly as the Trainer's strategy does (the model's own tensor-parallel plan, ``fully_shard`` per block,
activation checkpointing, meta-device materialization, pretrained weights), ``setup_optimizer`` checks the optimizer
holds the sharded parameters, every forward runs in the step's context (:class:`~cuboid.fabric.FabricPrecision`),
``clip_gradients`` clips by the global norm, ``all_reduce``/``all_gather`` run over the data-parallel ranks, and
``save``/``load`` write and read the Trainer's checkpoint formats (:mod:`cuboid.checkpoint.fabric`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from cuboid import compat
from cuboid.base import MeshCollectives, own_precision
from cuboid.checkpoint import Checkpointer
from cuboid.fabric import checkpoints as fabric_checkpoint
from cuboid.fabric.optimizers import NoGradientSync, check_optimizer, optimizers_follow
from cuboid.fabric.precision import FabricPrecision
from cuboid.job import pod_environment
from cuboid.parallel import (
    FLATTENED,
    ACMode,
    BuildSettings,
    check_no_fsdp1,
    check_reshard_after_forward,
    find_blocks,
    is_parallelized_by_user,
    resolve_plan,
    without_loss_parallel,
)
from cuboid.pipeline import PipelineError
from cuboid.step import DeferMode, check_tp_gradients, clip_grad_norm_, whole_matrix_steps
from cuboid.storage import to_path


class CuboidStrategy(MeshCollectives, ParallelStrategy):
    """Train a Fabric loop's model on a dp_replicate x dp_shard x cp x tp cuboid: ``Fabric(strategy=CuboidStrategy(
    tensor_parallel=2))`` or ``Fabric(strategy="cuboid")``. The arguments are the Trainer's
    :class:`cuboid.CuboidStrategy`'s, for what a Fabric loop can use (``docs/fabric.md``):

    Args:
        data_parallel_replicate: HSDP replicas (``dp_replicate``); ``1`` = plain FSDP.
        data_parallel_shard: FSDP shard group (``dp_shard``); ``"auto"`` fills the world size.
        tensor_parallel: Tensor-parallel degree (``tp``), from the model's own plan or ``tensor_parallel_plan``
            (names as seen from the module given to ``fabric.setup``).
        context_parallel: Each sequence split over ``cp`` ranks; the model's output is made whole again over the
            sequence after each forward, so the loop's loss is unchanged.
        expert_parallel: Ranks each mixture-of-experts layer's experts are split over, within ``dp_shard``.
        load_balancing: An MoE's load-balancing loss over the whole step (``"global"``) or each rank's batch.
        expert_bias_rate: An MoE's experts balanced without a loss, by a bias on each router's choice moved this much
            after each optimizer step (``1e-3``); None: off.
        pipeline_parallel: Must be 1: a Fabric loop has no step for a pipeline schedule to replay (use the Trainer).
        tensor_parallel_plan, block_container, activation_checkpointing, reshard_after_forward, cpu_offload,
            compile, checkpoint_format, process_group_backend, timeout, weights_init: as the Trainer's strategy.
        defer_reductions: What ``fabric.no_backward_sync(model)`` defers to the step that steps the optimizer, as the
            Trainer's strategy: ``"replicas"``, HSDP's all-reduce (the reduce-scatter runs each step, memory as
            without accumulation); ``"all"``, the reduce-scatter too (each rank keeps unsharded gradients meanwhile).
        pretrained: Weights to load per shard, keyed by a module name relative to the module given to
            ``fabric.setup`` (``""`` = all of it), valued by a transformers directory or safetensors file.
    """

    strategy_name = "cuboid"

    def __init__(
        self,
        data_parallel_replicate: int = 1,
        data_parallel_shard: int | Literal["auto"] = "auto",
        tensor_parallel: int = 1,
        context_parallel: int = 1,
        expert_parallel: int = 1,
        load_balancing: Literal["global", "local"] = "global",
        expert_bias_rate: float | None = None,
        pipeline_parallel: int = 1,
        tensor_parallel_plan: Mapping[str, str] | None = None,
        block_container: str | None = None,
        activation_checkpointing: ACMode | None = None,
        reshard_after_forward: bool | int | None = None,
        cpu_offload: bool = False,
        compile: bool = False,
        checkpoint_format: Literal["sharded", "full"] = "sharded",
        pretrained: Mapping[str, str | Path | None] | None = None,
        weights_init: Literal["auto", "rank0", "local"] = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        defer_reductions: DeferMode | None = "replicas",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
    ) -> None:
        if pipeline_parallel != 1:
            raise PipelineError(
                f"pipeline_parallel={pipeline_parallel} under Fabric: a pipeline schedule runs forward and backward "
                "of every microbatch itself, and a Fabric loop has no training_step for it to replay. Train with "
                "L.Trainer(strategy=cuboid.CuboidStrategy(pipeline_parallel=...)) (the same LightningModule, "
                "unchanged), or use pipeline_parallel=1 with data, tensor and context parallel here."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self.init_build(BuildSettings.make(
            pipeline_parallel=pipeline_parallel, data_parallel_replicate=data_parallel_replicate, data_parallel_shard=data_parallel_shard,
            tensor_parallel=tensor_parallel, context_parallel=context_parallel, expert_parallel=expert_parallel,
            tensor_parallel_plan=tensor_parallel_plan, block_container=block_container,
            activation_checkpointing=activation_checkpointing, reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload, compile=compile, pretrained=pretrained, load_balancing=load_balancing,
            weights_init=weights_init, defer_reductions=defer_reductions, process_group_backend=process_group_backend,
            timeout=timeout, expert_bias_rate=expert_bias_rate))  # fmt: skip
        self.checkpointer = Checkpointer(checkpoint_format, False, barrier=self.barrier)
        self._num_nodes = 1
        self._module: nn.Module | None = None
        self._tp_gradients_checked = False  # the first optimizer step compares tp's whole parameters' gradients
        self._backward_sync_control = NoGradientSync(self.deferred)

    # ------------------------------------------------------------------ Fabric's plumbing
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def precision(self) -> FabricPrecision:
        if not isinstance(self._precision, FabricPrecision):
            self._precision = FabricPrecision(str(getattr(self._precision, "precision", "32-true")))
        return self._precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = own_precision(precision, FabricPrecision)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.cluster_environment = pod_environment(self.cluster_environment)  # a PyTorchJob pod's, if it is one
        env, nodes, procs = self.cluster_environment, self.num_nodes, self.num_processes
        check_reshard_after_forward(self.settings.reshard_after_forward, self.layout.resolve(nodes * procs).dp_shard)
        if not env.creates_processes_externally:
            self._launcher = compat.FabricSubprocessScriptLauncher(env, procs, nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        layout = self.start_mesh()
        hooks = {"step_context": self._step, "whole_output": self.context.gather_output}
        self._precision = FabricPrecision(self.precision.precision, self.device_mesh, FLATTENED, **hooks)
        rank_zero_info(f"Cuboid layout: {layout.describe()} on {self.world_size} processes (Fabric)")

    # ------------------------------------------------------------------ the model and its optimizers
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Parallelize ``module`` in place (or respect a model the user parallelized by hand) and return it."""
        check_no_fsdp1(module)
        if self._module is not None and self._module is not module:
            raise RuntimeError(
                "CuboidStrategy under Fabric sets up one model per Fabric (its mesh, plan and step context are the "
                "model's). Put the models in one nn.Module, or give each its own Fabric."
            )
        if is_parallelized_by_user(module):
            holder = nn.Module()
            holder.add_module(_HELD, module)
            self.fill_parallelized_by_user(holder, module, {_child(k): v for k, v in self.settings.pretrained.items()})
        elif self._module is None:
            self._parallelize(module)
        self._module = module
        self.checkpointer.make_group()
        if not self.settings.cpu_offload:
            module.to(self.root_device)
        return module

    def _parallelize(self, module: nn.Module) -> None:
        matched = without_loss_parallel(resolve_plan(module, self.settings.tensor_parallel_plan, self.layout.tp))
        module = self.precision.convert_module(module)
        blocks = find_blocks(module, self.settings.block_container)
        # The weights are prepared and filled as a LightningModule's child's are, so that a model built on meta is
        # initialised by its own init as a whole (a transformers model's _init_weights reaches its lm_head too).
        holder, pretrained = nn.Module(), {_child(k): v for k, v in self.settings.pretrained.items()}
        holder.add_module(_HELD, module)
        # the model is one FSDP root with its blocks (as a LightningModule's child is), not each of its children
        held_blocks = [(_child(name), block) for name, block in blocks]
        held_plan = {_child(k): v for k, v in matched.items()}
        self.build_model(holder, held_blocks, held_plan, self.precision.mixed_precision_policy, pretrained)
        self.hook_step(module, blocks, root=module)
        self.describe_build(blocks, matched)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, optimizer)`` with an optimizer made before sharding: its parameter groups are
        pointed at the sharded parameters (by name). An optimizer that already holds state is refused."""
        with optimizers_follow(module, optimizers):
            module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that ``optimizer`` steps the model's sharded parameters (not copies from before ``fabric.setup``)."""
        if self._module is not None:
            check_optimizer(optimizer, self._module)
        self.expert_bias.watch([optimizer])  # the bias moves after the routers' optimizer steps
        return optimizer

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """``fabric.setup_dataloaders``: workers seeded by the data-parallel rank, not the global one, under
        ``seed_everything(workers=True)`` (tp, cp and pp peers draw the same random crops)."""
        return compat.seed_workers_by_data_rank(dataloader, self.distributed_sampler_kwargs["rank"])

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # weights move to the device while they are sharded, in setup_module

    @override
    def module_init_context(self, empty_init: bool | None = None) -> Any:
        """``fabric.init_module(empty_init=True)`` builds on the meta device; ``setup`` materializes the shards."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @contextmanager
    def _step(self) -> Generator[None, None, None]:
        with self.context.step() if self.context.enabled else nullcontext(), self.load_balancing.step():
            yield

    # ------------------------------------------------------------------ the step's numerics and collectives
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer's step; before the first one, the parameters tp leaves whole must have the same gradient on
        every tp rank (:mod:`cuboid.step.tp_gradients`: one small collective, once)."""
        if self._module is not None:  # no unit kept gradients it never averaged across the replicas
            self.deferred.check_reduced(self._module)
        if not self._tp_gradients_checked and self._module is not None:
            self._tp_gradients_checked = True
            tp = self.device_mesh["tp"]
            if tp.size() > 1:
                check_tp_gradients(self._module.named_parameters(), tp.get_group(), self.root_device)
        with whole_matrix_steps():  # torch's Muon orthogonalizes whole matrices (cuboid.step.muon)
            return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the global L2 norm over every shard of every parameter (as one process would). With
        ``error_if_nonfinite`` (Fabric's default) a NaN/Inf norm raises: one host read per call, as torch's own
        ``clip_grad_norm_``; pass ``error_if_nonfinite=False`` for none."""
        if float(norm_type) != 2.0:
            raise ValueError(f"CuboidStrategy clips by the global L2 norm; norm_type={norm_type} is not supported.")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = clip_grad_norm_(params, float(max_norm), self.device_mesh, FLATTENED, set())
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"The total norm of the gradients is {float(norm)}: non-finite, so clipping them is meaningless. "
                "Pass error_if_nonfinite=False to fabric.clip_gradients to clip anyway."
            )
        return norm

    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Over the data-parallel ranks by default (tp and cp peers hold the same values)."""
        return self.reduce_over_dp(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Over the data-parallel ranks by default (one copy per batch, not one per tp or cp peer)."""
        if group is None and self.dims.built:
            group = self.dp_group
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write ``state`` in the Trainer's format (``checkpoint_format``): loads on any layout, and in a Trainer."""
        if filter is not None:
            raise TypeError(
                "fabric.save with CuboidStrategy writes every rank's shards as a whole checkpoint: filter is not "
                "supported (save a submodule's state_dict() under its own key instead)."
            )
        assert self._module is not None, "fabric.save before fabric.setup(model)"
        target = to_path(self.broadcast(str(path)), storage_options)  # a local path, or a URL fsspec reaches
        fabric_checkpoint.save(self.checkpointer, target, state, self._module, self.layout.degrees, self.device_mesh)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a Cuboid checkpoint of any layout (a Fabric loop's or a Trainer's)."""
        assert self._module is not None, "fabric.load before fabric.setup(model)"
        if isinstance(state, Optimizer):
            raise TypeError("fabric.load(path, optimizer): pass {'model': model, 'optimizer': optimizer} instead.")
        target = to_path(self.broadcast(str(path)))
        return fabric_checkpoint.load(self.checkpointer, target, state or {}, self._module, strict, weights_only)

    @override
    def teardown(self) -> None:
        self.checkpointer.wait(raise_error=False)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Cuboid for Fabric: FSDP2 x tensor x context parallel on one mesh"
        )


_HELD = "model"  # the set-up module's name inside the holder its weights are prepared in


def _child(name: str) -> str:
    """A name relative to the set-up module (``""``: the module itself), as seen from its holder."""
    return f"{_HELD}.{name}" if name else _HELD
