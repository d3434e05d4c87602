"""The Lightning glue: :class:`CuboidStrategy`, a ``ParallelStrategy`` on a pp x dp x tp mesh."""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from cuboid import compat, fit, loss_parallel, plans
from cuboid import pretrained as pretrained_weights
from cuboid.checkpoint_glue import Checkpointer
from cuboid.faults import JobGuard
from cuboid.launch import (
    CuboidLauncher,
    check_before_launch,
    check_external_launch,
    destroy_process_group_at_exit,
    forget_previous_launch,
)
from cuboid.mesh import DP_DIMS, MESH_NAMES, Layout, build_device_mesh, check_reshard_after_forward
from cuboid.nonfinite import NonFiniteGuard
from cuboid.parallelize import (
    ACMode,
    check_ac_mode,
    check_no_fsdp1,
    is_parallelized_by_user,
    parallelize_lightning_module,
)
from cuboid.pipeline_steps import Pipelining, batch_and_index
from cuboid.precision import CuboidPrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision

_FLATTENED = {"dp": DP_DIMS}


class CuboidStrategy(ParallelStrategy):
    """Train one LightningModule on a pp x dp_replicate x dp_shard x tp cuboid of devices.

    FSDP2 (``fully_shard``) shards parameters, gradients and optimizer state over ``dp_shard``
    (replicated over ``dp_replicate`` for HSDP); tensor parallelism (DTensor) splits layers over
    ``tp`` from a declarative plan. The LightningModule needs no parallel code: Cuboid finds the
    repeated blocks, applies the model's tensor-parallel plan, activation checkpointing and
    ``fully_shard`` per block. A ``configure_model`` that parallelizes by hand (it calls
    ``fully_shard`` or makes DTensors, using ``self.device_mesh``) is respected as is.

    Args:
        pipeline_parallel: Pipeline-parallel degree (the ``pp`` mesh dim, outermost). The model must be
            pipeline-ready (``pre -> blocks in an nn.ModuleDict -> post``, skipping pieces that are
            ``None``); the LightningModule's ``training_step``/``validation_step`` run unchanged, as long
            as they call ``self.model(...)`` once and issue no collectives themselves.
        data_parallel_replicate: HSDP replicas (``dp_replicate``): parameters are sharded within a
            replica group and replicated across groups. ``1`` = plain FSDP.
        data_parallel_shard: FSDP shard group size (``dp_shard``); ``"auto"`` fills the world size. On a GPU,
            setup refuses a layout whose parameters and gradients alone exceed the device before anything is
            materialized, with the estimate and the shard group that would hold them (:mod:`cuboid.fit`).
        tensor_parallel: Tensor-parallel degree (``tp``), the innermost dim: keep it within a node.
        tensor_parallel_plan: Module-name glob -> style (``"colwise"``, ``"rowwise"``,
            ``"embedding"``, ``"output"``, ``"sequence_parallel"``), names as seen from the
            LightningModule, e.g. ``{"model.layers.*.attention.wq": "colwise"}``. Default: the
            model's own ``tp_plan`` (or a Hugging Face ``_tp_plan``), prefixed with its attribute name.
        pipeline_schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"InterleavedZeroBubble"``,
            ``"ZBVZeroBubble"`` or ``"LoopedBFS"`` (``torch.distributed.pipelining``).
        microbatches: Microbatches per step; each rank's batch size must be a multiple. Default:
            ``2 x pipeline_parallel x virtual_stages``.
        virtual_stages: Stages per rank: 1 for GPipe/1F1B, default 2 for the interleaved and V schedules.
        pipeline_split: Blocks per stage (``pipeline_parallel x virtual_stages`` numbers); default even.
        block_container: Name of the ModuleList/ModuleDict whose children are the blocks
            (e.g. ``"model.layers"``). Default: found automatically.
        activation_checkpointing: ``None``, ``"full"`` (recompute each block in backward) or
            ``"selective"`` (keep matmul/attention outputs, recompute the rest).
        reshard_after_forward: ``True`` frees each block's gathered parameters after forward
            (ZeRO-3); ``False`` keeps them until backward (ZeRO-2 style, more memory, less
            communication); an ``int`` reshards to a smaller group of that size. ``None`` (default):
            ``True``, except ``False`` under pipeline parallelism (each block would be re-gathered for
            every microbatch; the zero-bubble schedules' split weight-gradient pass needs it gathered anyway).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in host memory (FSDP2's
            ``CPUOffloadPolicy``; the optimizer step runs on the host). Accelerators only.
        compile: ``torch.compile`` each block (in place, parameter names unchanged).
        async_checkpoint: Write checkpoints in the background: training continues once the shards
            are copied to host memory; the next save, a checkpoint deletion and teardown wait for it.
        checkpoint_format: ``"sharded"`` (default): a directory, every rank writing its own shards
            with ``torch.distributed.checkpoint``; scales to any model. ``"full"``: one file, gathered
            parameter by parameter into rank 0's host memory (models whose weights and optimizer
            state fit there); also a plain Lightning checkpoint (``load_from_checkpoint`` reads it).
            Both resume on any layout, and either loads whatever ``checkpoint_format`` is set.
        pretrained: Submodule name of the LightningModule -> weights to fill it with after sharding, e.g.
            ``{"model": "/ckpt/Llama-3.1-8B"}``. A Hugging Face model directory (``model.safetensors`` or
            sharded files with ``model.safetensors.index.json``), one ``.safetensors`` file, or a Cuboid
            checkpoint (its weights only). Build the submodule on the meta device (in ``configure_model``, or
            ``CausalLM(meta_init=True)``): each rank then reads only the slices it holds. Names match 1:1, with
            the submodule's prefix, or through the submodule's ``pretrained_names()`` adapter (Cuboid's Llama
            has one for Hugging Face Llama files). Missing, unexpected or misshapen tensors stop setup, with
            the list, before anything is loaded. ``None`` values are ignored (Hydra's empty default).
        preempt_on: Signals on which every rank, after the same optimizer step, saves one checkpoint
            (``preempted-step=N.ckpt`` in the ModelCheckpoint's directory, else ``<default_root_dir>/checkpoints``)
            and stops; rank 0 then asks SLURM to requeue the job (``scontrol requeue``) when it runs under one.
            Default ``("SIGUSR1", "SIGTERM")``: what ``sbatch --signal=USR1@120`` and SLURM's preemption send.
            ``()``: a SIGTERM stops every rank at the same step without saving (Lightning's behaviour). A signal
            to any one rank counts; handlers never run a collective. Resume with ``ckpt_path="auto"`` in the main
            job, or ``cuboid.latest_checkpoint(directory)``.
        nonfinite: ``"raise"``: a NaN/Inf loss (on any rank) or global gradient norm stops every rank before the
            optimizer step, naming the step and the ranks (:class:`cuboid.nonfinite.NonFiniteError`). ``"skip"``:
            that optimizer step is dropped on every rank together, with a warning. Either way no update and no
            checkpoint comes from non-finite values. Costs one host read per optimizer step; ``None`` (default)
            checks nothing.
        peer_timeout: Seconds without a heartbeat (through the rendezvous store, once a second) after which a rank
            is taken for dead: every other rank stops with a message naming it (exit code 3) instead of waiting
            in a collective until ``timeout``. ``None`` or ``0``: no watchdog (env ``CUBOID_PEER_TIMEOUT``
            overrides).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default by device.
        timeout: Timeout for collectives, a ``timedelta`` or seconds (default 30 min, as Lightning), on every
            group: each mesh dimension's too (torch would give those its own default). A collective that times
            out stops every rank (the stuck one too), with an error that names the collective, its mesh dimension
            and the ranks that never joined it (see :mod:`cuboid.hangs`).
        flight_recorder: Entries in torch's flight recorder (the last collectives of each rank; 0 turns it off),
            dumped to ``<default_root_dir>/flight_recorder/rank_<r>`` on a timeout (on NCCL by torch's watchdog,
            where ``torchfrtrace <that dir> -p rank_`` compares the ranks). Default 20000, as torchtitan.
    """

    strategy_name = "cuboid"

    def __init__(
        self,
        pipeline_parallel: int = 1,
        data_parallel_replicate: int = 1,
        data_parallel_shard: int | Literal["auto"] = "auto",
        tensor_parallel: int = 1,
        tensor_parallel_plan: Mapping[str, str] | None = None,
        pipeline_schedule: str = "1F1B",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        pipeline_split: Sequence[int] | None = None,
        block_container: str | None = None,
        activation_checkpointing: ACMode | None = None,
        reshard_after_forward: bool | int | None = None,
        cpu_offload: bool = False,
        compile: bool = False,
        async_checkpoint: bool = False,
        checkpoint_format: Literal["sharded", "full"] = "sharded",
        pretrained: Mapping[str, str | Path | None] | None = None,
        preempt_on: Sequence[str] = ("SIGUSR1", "SIGTERM"),
        nonfinite: Literal["raise", "skip"] | None = None,
        peer_timeout: float | None = 6.0,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        flight_recorder: int = 20000,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.pipelining = Pipelining(
            pipeline_parallel,
            pipeline_schedule,
            microbatches,
            virtual_stages,
            pipeline_split,
            reshard_after_forward,
            activation_checkpointing,
        )
        check_ac_mode(activation_checkpointing)
        if tensor_parallel_plan is not None:
            for pattern, style in tensor_parallel_plan.items():
                plans.canonical_style(style, pattern)
        self.layout = Layout(pipeline_parallel, data_parallel_replicate, data_parallel_shard, tensor_parallel)
        self._dp_shard_auto = data_parallel_shard == "auto"
        self.fit_estimate: fit.Estimate | None = None  # parameter bytes per rank, estimated before sharding
        self.tensor_parallel_plan = dict(tensor_parallel_plan) if tensor_parallel_plan is not None else None
        self.block_container = block_container
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = self.pipelining.reshard_after_forward
        self.cpu_offload = cpu_offload
        self.compile = compile
        self.pretrained = {str(k): str(v) for k, v in (pretrained or {}).items() if v is not None}
        self._pretrained_loaded = False
        self.nonfinite = NonFiniteGuard(nonfinite)
        self.loss_parallel = loss_parallel.LossParallel()  # on when the plan keeps logits vocabulary-sharded
        self.checkpointer = Checkpointer(checkpoint_format, async_checkpoint, barrier=self.barrier)
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        peer_timeout = float(os.environ.get("CUBOID_PEER_TIMEOUT", peer_timeout or 0))
        self.faults = JobGuard(preempt_on, peer_timeout, self._timeout or default_pg_timeout, flight_recorder)
        self._device_mesh: DeviceMesh | None = None
        self._dp_mesh: DeviceMesh | None = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ layout and mesh
    @property
    def device_mesh(self) -> DeviceMesh:
        """The 4-D mesh ``("pp", "dp_replicate", "dp_shard", "tp")``."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have started (setup_environment).")
        return self._device_mesh

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

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Split data over the data-parallel ranks only: tp (and pp) peers get the same batch."""
        dp_mesh = self.dp_mesh
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

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

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Check the layout in the launching process, before any child process or process group exists.
        resolved = self.layout.resolve(self.num_nodes * self.num_processes)
        check_reshard_after_forward(self.reshard_after_forward, resolved.dp_shard)
        check_external_launch(self.cluster_environment, self.num_nodes, self.num_processes)  # before root_device
        check_before_launch(
            self.cluster_environment, self.num_nodes, self.num_processes, self.cpu_offload, self.root_device
        )
        forget_previous_launch()
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = CuboidLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        layout = self.layout.resolve(self.world_size)
        self._process_group_backend = self._process_group_backend or compat.default_process_group_backend(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        trainer = getattr(self.lightning_module, "_trainer", None)
        self.faults.before_process_group(
            getattr(trainer, "default_root_dir", None) or os.getcwd(), self._process_group_backend
        )
        compat.init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        destroy_process_group_at_exit()
        self.faults.after_process_group(self.global_rank, self.world_size)
        self.layout = layout
        self._device_mesh, self._dp_mesh = build_device_mesh(layout, self.root_device.type)
        self.faults.after_mesh(self._device_mesh, MESH_NAMES, self.global_rank)
        self._precision_plugin = CuboidPrecision(self.precision_plugin.precision, self._device_mesh, _FLATTENED)
        self._precision_plugin.nonfinite = self.nonfinite
        assert self.lightning_module is not None
        compat.set_module_device_mesh(self.lightning_module, self._device_mesh)
        rank_zero_info(f"Cuboid layout: {layout.describe()} on {self.world_size} processes")

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A timed-out collective is named and every rank stopped; after another failed collective the watchdog
        gets its few seconds to name a dead rank (see :class:`cuboid.faults.JobGuard`)."""
        self.faults.on_exception(exception)

    @property
    def preempted_to(self) -> Path | None:
        """The checkpoint a preemption signal made the last ``fit`` save, if any."""
        return self.faults.preempted_to

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        assert lm is not None
        check_no_fsdp1(lm)
        self.checkpointer.guard_callbacks(trainer.callbacks)
        if is_parallelized_by_user(lm):  # by the user's configure_model, or by Cuboid in an earlier fit/validate
            sources = [] if self._pretrained_loaded else pretrained_weights.plan_all(lm, self.pretrained)
            compat.materialize_distributed_module(lm, self.root_device)
            for source in sources:
                pretrained_weights.load(lm, source)
        else:
            self._parallelize(lm)
        self._pretrained_loaded = True  # a later fit/validate on the same model keeps what it has learned
        self.checkpointer.make_group()
        self.faults.extra_group(self.checkpointer.group)
        self.faults.setup(
            trainer, trainer.state.fn == TrainerFn.FITTING, self.checkpointer.failure, self.checkpointer.settle
        )
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.optimizers, self.lr_scheduler_configs = [], []
            self.setup_optimizers(trainer)
            capacity = self._device_capacity()
            if capacity is not None:  # with the optimizers' own state now: a layout that cannot fit, refused
                fit.check_fits(lm, self.optimizers, capacity, f"The layout {self.layout.describe()}")
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            compat.optimizers_to_device(self.optimizers, self.root_device)

    def _device_capacity(self) -> float | None:
        """Bytes a rank's parameters, gradients and optimizer state may take on its device (a GPU's total memory);
        None where nothing is checked: on CPU, and with CPU offload (they live on the host)."""
        if self.root_device.type != "cuda" or self.cpu_offload:
            return None
        return float(torch.cuda.get_device_properties(self.root_device).total_memory)

    def _parallelize(self, lm: pl.LightningModule) -> None:
        matched = plans.resolve_plan(lm, self.tensor_parallel_plan, self.layout.tp)
        matched, self.loss_parallel.enabled = loss_parallel.under_pipeline(matched, self.layout.pp)
        if self.layout.pp > 1:  # positions in a Lightning optimizer state follow the whole model's order
            self.checkpointer.model_order = [name for name, _ in lm.named_parameters()]
        lm = self.precision_plugin.convert_module(lm)
        self.fit_estimate = fit.estimate(
            lm, self.layout, matched, plans.find_blocks(lm, self.block_container), self.pipelining
        )
        capacity = self._device_capacity()
        if capacity is not None:  # parameters and gradients alone cannot fit: refused before any allocation
            fit.refuse_if_too_big(self.fit_estimate, self.layout, capacity, self._dp_shard_auto)
        blocks = parallelize_lightning_module(
            lm,
            self.device_mesh,
            matched,
            self.pipelining,
            self.root_device,
            block_container=self.block_container,
            mp_policy=self.precision_plugin.mixed_precision_policy,
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            pretrained=self.pretrained,
        )
        self.precision_plugin.counted_elsewhere = self.pipelining.counted_elsewhere
        rank_zero_info(
            f"Cuboid: {len(blocks)} blocks ({blocks[0][0] if blocks else 'none found'} ...), tp plan on "
            f"{len(matched)} modules, activation checkpointing={self.activation_checkpointing}"
            + (f", {self.pipelining.describe()}" if self.layout.pp > 1 else "")
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.cpu_offload:
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` builds on the meta device; Cuboid materializes shards in ``setup``."""
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ steps (pipelining owns them when pp > 1)
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp > 1 the schedule runs forward and backward of every microbatch; the loss returned (the
        microbatch mean) is the same on every rank."""
        if not self.pipelining.enabled:
            with self.loss_parallel.step(self.lightning_module):
                return loss_parallel.plain_output(super().training_step(*args, **kwargs))
        batch, batch_idx = batch_and_index(args, kwargs)
        lm = self.lightning_module
        return self.pipelining.training_step(lm, batch, batch_idx, self.precision_plugin, self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not self.pipelining.enabled:
            with self.loss_parallel.backward():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pipelining.restore_grads(self.lightning_module)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelining.enabled:
            with self.loss_parallel.step(self.lightning_module):
                return loss_parallel.plain_output(super().validation_step(*args, **kwargs))
        return self._pipelined_eval("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelining.enabled:
            with self.loss_parallel.step(self.lightning_module):
                return loss_parallel.plain_output(super().test_step(*args, **kwargs))
        return self._pipelined_eval("test_step", args, kwargs)

    def _pipelined_eval(self, hook: str, args: tuple, kwargs: dict) -> Any:
        batch, idx = batch_and_index(args, kwargs)
        return self.pipelining.eval_step(
            self.lightning_module, hook, batch, idx, self.precision_plugin, self.root_device
        )

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipelining.enabled:
            self.pipelining.refuse_predict()
        return super().predict_step(*args, **kwargs)

    @override
    def on_train_start(self) -> None:
        if self.pipelining.enabled:
            self.pipelining.check_loader(self.lightning_module.trainer.train_dataloader)

    # ------------------------------------------------------------------ checkpoints (the Checkpointer)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is written shard by shard in save_checkpoint

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # written shard by shard in save_checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CuboidStrategy.save_checkpoint(..., storage_options=...) is not supported.")
        assert self.model is not None and self.lightning_module is not None
        path = Path(self.broadcast(str(filepath)))
        trainer = self.lightning_module.trainer
        self.checkpointer.save(
            path, checkpoint, self.model, self.optimizers, trainer, self.layout.sizes, self.device_mesh
        )

    def wait_for_checkpoint(self) -> None:
        """Block until a background (async) save has been written and renamed into place."""
        self.checkpointer.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        strict = self.lightning_module.strict_loading
        return self.checkpointer.load(path, self.model, self.optimizers, strict, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpointer.remove(Path(filepath))

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """After a mid-epoch resume, skip the batches of the epoch that were already trained."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self.checkpointer.resume_loader(dataloader, trainer)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not compat.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce over the data-parallel group by default (what ``self.log(sync_dist=True)`` uses):
        tp and pp peers hold the same values and must not be counted again."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._device_mesh is not None:
            group = self.dp_group
        return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree on a decision over *every* rank (ModelCheckpoint's top-k, EarlyStopping, ...).

        Lightning's default sums the flag with :meth:`reduce`, which here covers the data-parallel
        group only, and compares it with the world size: under tp or pp the two never match.
        """
        if not compat.distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN if all else dist.ReduceOp.MAX)
        return bool(flag.item())

    @override
    def teardown(self) -> None:
        self.faults.teardown()  # first: a peer that finishes earlier must not look dead
        self.checkpointer.wait(raise_error=False)  # a failed background save was raised at the step after it
        self.faults.after_teardown()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Cuboid: FSDP2 x tensor parallel on a pp x dp x tp device mesh"
        )
