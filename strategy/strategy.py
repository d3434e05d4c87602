"""The Lightning glue: :class:`CuboidStrategy`, a ``ParallelStrategy`` on a pp x dp x cp x tp mesh. Each hook
delegates to a collaborator that owns its state: the layout and mesh (``cuboid.parallel``), the pipeline
(``cuboid.pipeline``), the checkpointer (``cuboid.checkpoint``), the job's guard (``cuboid.job``), context parallel
(``cuboid.context``), the step's numerics (``cuboid.step``). ``_parallelize`` picks a pipelined build or a plain one.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from cuboid import compat
from cuboid.base import MeshStrategy
from cuboid.checkpoint import Checkpointer, CheckpointHooks, DataPosition
from cuboid.choosing import ChoosingLayout
from cuboid.job import CuboidLauncher, JobGuard, prepare_launch
from cuboid.measure import Estimate, check_fits, hand_to_ledgers, refuse_if_too_big
from cuboid.measure import estimate as estimate_fit
from cuboid.parallel import (
    ACMode,
    BufferBroadcast,
    BuildSettings,
    check_no_fsdp1,
    check_reshard_after_forward,
    find_blocks,
    is_parallelized_by_user,
    resolve_plan,
    sync_batchnorm,
    with_loss_parallel,
)
from cuboid.pipeline import Pipelining, batch_and_index
from cuboid.replicas import FaultTolerance, ReplicaGroups
from cuboid.step import DeferMode, LossParallel, NonFiniteGuard, plain_output

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision


class CuboidStrategy(ChoosingLayout, CheckpointHooks, MeshStrategy):
    """Train one LightningModule on a pp x dp_replicate x dp_shard x cp x tp cuboid of devices.

    FSDP2 (``fully_shard``) shards parameters, gradients and optimizer state over ``dp_shard`` (replicated over
    ``dp_replicate`` for HSDP); tensor parallelism (DTensor) splits layers over ``tp`` from a declarative plan. The
    LightningModule needs no parallel code: Cuboid finds the repeated blocks, applies the model's tensor-parallel
    plan, activation checkpointing and ``fully_shard`` per block. A ``configure_model`` that parallelizes by hand
    (``fully_shard``, DTensors, ``self.device_mesh``) is respected as is.

    Args (the guide in ``docs/`` has the detail of each):
        pipeline_parallel: Pipeline stages (``pp``, the outermost dim). The LightningModule's own
            ``training_step``/``validation_step`` run per microbatch on the last stage, unchanged, as long as they
            call ``self.model(...)`` once and issue no collectives (``docs/pipeline.md``).
        data_parallel_replicate: HSDP replicas (``dp_replicate``); ``1`` = plain FSDP.
        data_parallel_shard: FSDP shard group (``dp_shard``); ``"auto"`` fills the world size. Left unset, a model
            whose weights, gradients and Adam state fit a quarter of each process's memory, with nothing but data
            parallel asked for, is replicated as DDP does (torch's ``DistributedDataParallel``: sharding it buys
            nothing), a larger one sharded as ``"auto"`` (``docs/parallelism.md``). On a GPU, a layout whose
            parameters and gradients alone exceed the device is refused before anything is materialized.
        tensor_parallel: Tensor-parallel degree (``tp``), the innermost dim: keep it within a node.
        context_parallel: Context-parallel degree (``cp``): each sequence split over ``cp`` ranks, load-balanced for
            causal attention; FSDP shards over ``dp_shard x cp``; the step is unchanged (``docs/context.md``).
        expert_parallel: Ranks each mixture-of-experts layer's experts are split over (``ep``), within ``dp_shard``;
            tokens reach their experts by all-to-all, the router is the model's own (``docs/experts.md``).
        load_balancing: An MoE's load-balancing loss over the ranks holding the step's tokens (``"global"``, as one
            process) or each rank's own batch (``"local"``, as DDP). expert_bias_rate: the experts balanced without
            a loss, by a bias on each router's choice moved this much per optimizer step (``1e-3``); None: off.
        tensor_parallel_plan: Module-name glob -> style (``"colwise"``, ``"rowwise"``, ``"embedding"``,
            ``"output"``, ``"sequence_parallel"``), names as seen from the LightningModule, e.g.
            ``{"model.layers.*.attention.wq": "colwise"}``. Default: the model's own ``tp_plan`` (or a Hugging Face
            ``_tp_plan``), prefixed with its attribute name.
        pipeline_schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"InterleavedZeroBubble"``,
            ``"ZBVZeroBubble"``, ``"LoopedBFS"`` or ``"DualPipeV"`` (``torch.distributed.pipelining``).
        microbatches: Per step; each rank's batch size must be a multiple. Default ``2 x pp x virtual_stages``.
        virtual_stages: Stages per rank: 1 for GPipe/1F1B, default 2 for the interleaved and V schedules.
        pipeline_split: Blocks per stage (``pp x virtual_stages`` numbers); default even.
        block_container: The ModuleList/ModuleDict whose children are the blocks (``"model.layers"``); default found.
        activation_checkpointing: ``None``, ``"full"`` (recompute each block) or ``"selective"`` (keep matmul and
            attention outputs).
        reshard_after_forward: ``True`` frees each block's gathered parameters after forward (ZeRO-3), ``False``
            keeps them until backward, an ``int`` reshards to a group of that size. ``None``: ``True``, but
            ``False`` under pp (each block would be re-gathered for every microbatch).
        cpu_offload: Sharded parameters, gradients and optimizer state in host memory (accelerators only).
        compile: ``torch.compile`` each block (in place, parameter names unchanged).
        async_checkpoint: Write checkpoints in the background once the shards are in host memory.
        checkpoint_format: ``"sharded"`` (a DCP directory, every rank its shards) or ``"full"`` (one Lightning file
            gathered on rank 0, which ``torch.load`` and ``load_from_checkpoint`` read); both resume on any layout.
            Default: ``"full"`` for a replicated model, ``"sharded"`` otherwise (``docs/checkpoints.md``).
        data_position: A mid-epoch resume starts ``"exact"``ly where the checkpoint was taken (on any dp degree with
            Lightning's ``DistributedSampler``; a loader with per-rank state at its own degree) or at the ``"epoch"``'s start.
        fault_tolerance: This job is one torchft replica group (:class:`cuboid.FaultTolerance` or its mapping):
            gradients averaged over the live groups, a restarted group healed by a live one (``docs/fault-tolerance.md``).
        pretrained: Submodule -> weights to fill it with after sharding, e.g. ``{"model": "/ckpt/Llama-3.1-8B"}``: a
            Hugging Face directory, a ``.safetensors`` file or a Cuboid checkpoint. Build the submodule on meta and
            each rank reads only its slices; a mismatch stops setup before anything is loaded (``None`` ignored).
        weights_init: How a model built on the meta device gets its first values: ``"rank0"``, rank 0 runs the
            model's own init piece by piece and sends each rank its slice (one process's values, on any layout);
            ``"local"``, each rank initializes its own shards with DTensor's random streams (the same distribution,
            nothing sent); ``"auto"``: ``"local"`` on GPUs, ``"rank0"`` on CPU and under ``cpu_offload``. Nothing
            is initialized that a checkpoint about to be loaded fills.
        preempt_on: Signals on which every rank saves one checkpoint after the same step and stops; under SLURM the
            job is requeued (by the batch script once srun returns, where it sets ``CUBOID_REQUEUE_FILE``; else by
            rank 0). ``()``: a SIGTERM stops every rank without saving (``docs/cluster.md``).
        nonfinite: ``"raise"``: a NaN/Inf loss or gradient norm stops every rank before the optimizer step
            (:class:`cuboid.NonFiniteError`); ``"skip"`` drops that step. One host read per step; ``None``: none.
        peer_timeout: Seconds without a heartbeat after which a rank is taken for dead and every other rank stops,
            naming it (exit code 3). ``None`` or ``0``: no watchdog (env ``CUBOID_PEER_TIMEOUT`` overrides).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default by device.
        timeout: For collectives on every group (``timedelta`` or seconds, default 30 min). A timed-out collective
            stops every rank, naming the collective, its mesh dimension and the ranks that never joined.
        flight_recorder: Entries in torch's flight recorder (0: off), dumped under
            ``<default_root_dir>/flight_recorder`` on a timeout. Default 20000, as torchtitan.
        broadcast_buffers: As DDP's: the first data-parallel rank's buffers (BatchNorm's statistics) changed by a
            step go to the others before each step and save; ``"all"``: every buffer; ``False``: none.
        layout: ``"auto"``: the layout, checkpointing and micro-batches chosen at setup from one step measured on
            fake tensors; sizes given other than 1 are kept; the choice, its predicted memory and time and the
            runner-up are printed (``docs/planning.md``). device_memory: what it plans for per device ("80GB").
        defer_reductions: While gradients accumulate, what waits for the step's last microbatch: ``"replicas"``,
            HSDP's all-reduce across replicas (once per step, same memory); ``"all"``, the reduce-scatter too
            (unsharded gradients kept meanwhile); ``None``, nothing (``docs/performance.md``).
    """

    strategy_name = "cuboid"

    def __init__(
        self,
        pipeline_parallel: int = 1,
        data_parallel_replicate: int = 1,
        data_parallel_shard: int | Literal["auto"] | None = None,
        tensor_parallel: int = 1,
        context_parallel: int = 1,
        expert_parallel: int = 1,
        load_balancing: Literal["global", "local"] = "global",
        expert_bias_rate: float | None = None,
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
        checkpoint_format: Literal["sharded", "full"] | None = None,
        data_position: Literal["exact", "epoch"] = "exact",
        fault_tolerance: FaultTolerance | Mapping[str, Any] | None = None,
        pretrained: Mapping[str, str | Path | None] | None = None,
        weights_init: Literal["auto", "rank0", "local"] = "auto",
        preempt_on: Sequence[str] = ("SIGUSR1", "SIGTERM"),
        nonfinite: Literal["raise", "skip"] | None = None,
        peer_timeout: float | None = 6.0,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        flight_recorder: int = 20000,
        broadcast_buffers: bool | Literal["all"] = True,
        defer_reductions: DeferMode | None = "replicas",
        layout: Literal["auto"] | None = None,
        device_memory: float | str | None = None,
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
        self.init_build(BuildSettings.make(
            pipeline_parallel=pipeline_parallel, data_parallel_replicate=data_parallel_replicate,
            data_parallel_shard=data_parallel_shard, tensor_parallel=tensor_parallel, context_parallel=context_parallel,
            expert_parallel=expert_parallel, tensor_parallel_plan=tensor_parallel_plan, block_container=block_container,
            activation_checkpointing=activation_checkpointing, reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload, compile=compile, pretrained=pretrained, load_balancing=load_balancing,
            weights_init=weights_init, defer_reductions=defer_reductions, process_group_backend=process_group_backend,
            timeout=timeout, layout=layout, device_memory=device_memory, expert_bias_rate=expert_bias_rate))  # fmt: skip
        self._pipeline_args = (pipeline_schedule, microbatches, virtual_stages, pipeline_split)
        self.pipelining = Pipelining(self.dims, *self._pipeline_args, self.settings.reshard_after_forward)
        self._replicated_format = checkpoint_format or "full"  # a replicated model writes one file, as DDP does
        self.fit_estimate: Estimate | None = None  # parameter bytes per rank, estimated before sharding
        self.layout_choice: dict[str, Any] | None = None  # layout="auto": the arguments it chose (and the bytes
        self.layout_prediction: dict[str, float] | None = None  # per rank it predicted, "peak" and by kind)
        self._pretrained_loaded = False
        self.nonfinite = NonFiniteGuard(nonfinite)
        self.loss_parallel = LossParallel()  # on when the plan keeps logits vocabulary-sharded
        position = DataPosition(data_position)  # where a mid-epoch resume starts, checked here
        self.checkpointer = Checkpointer(checkpoint_format or "sharded", async_checkpoint, self.barrier, position)
        config = FaultTolerance.of(fault_tolerance)
        shared = config.lighthouse if config is not None else None  # replica groups share checkpoint directories
        peer = float(os.environ.get("CUBOID_PEER_TIMEOUT", peer_timeout or 0))
        timeout = self.settings.timeout or default_pg_timeout
        self.job_guard = JobGuard(preempt_on, peer, timeout, flight_recorder, shared)
        self.replicas = ReplicaGroups(config, data_parallel_replicate) if config is not None else None
        self.num_nodes = 1
        self.buffers = BufferBroadcast(broadcast_buffers)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None  # before any child process exists:
        env, nodes = prepare_launch(self.cluster_environment, self.num_nodes, self.num_processes, self.layout,
                                    self.settings.cpu_offload, lambda: self.root_device)  # fmt: skip
        self.cluster_environment, self.num_nodes, procs = env, nodes, self.num_processes
        check_reshard_after_forward(self.settings.reshard_after_forward, self.layout.resolve(nodes * procs).dp_shard)
        if not env.creates_processes_externally:
            self._launcher = CuboidLauncher(env, procs, nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        compat.set_num_threads_if_needed(self.num_processes)  # as Lightning's DDP: no rank takes every core
        trainer = getattr(self.lightning_module, "_trainer", None)
        root_dir = getattr(trainer, "default_root_dir", None) or os.getcwd()
        layout = self.start_mesh(before_group=lambda backend: self.job_guard.before_process_group(root_dir, backend),
                                 after_group=lambda: self.job_guard.after_process_group(self.global_rank, self.world_size))  # fmt: skip
        self._after_mesh()
        pending = ", the data-parallel ranks sharded or replicated by the model's size"
        pending *= self.settings.replicate_if_it_fits
        pending = (
            ", the rest chosen at setup from the measured model (layout='auto')"
            if self.settings.layout_auto
            else pending
        )
        rank_zero_info(f"Cuboid layout: {layout.describe()} on {self.world_size} processes{pending}")

    @override
    def on_exception(self, exception: BaseException) -> None:  # a timed-out collective named, every rank stopped
        self.job_guard.on_exception(exception)  # else the watchdog may name a dead rank (JobGuard)

    @property
    def preempted_to(self) -> Path | None:
        """The checkpoint a preemption signal made the last ``fit`` save, if any."""
        return self.job_guard.preempted_to

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        check_no_fsdp1(lm)
        self.release_calls(lm)  # an earlier run's gathered methods (cuboid.dropin.kept): in a run FSDP2's hooks gather
        self.checkpointer.guard_callbacks(trainer.callbacks)
        hand_to_ledgers(trainer.callbacks, self.experts_layout, self.replicas)  # what a CommLedger reads of the run
        if self.settings.layout_auto and trainer.state.fn == TrainerFn.FITTING and not is_parallelized_by_user(lm):
            self.choose_layout(trainer, lm, self._pipeline_args)  # the degrees and meshes of the choice
        sync_batchnorm(compat.layer_sync(self), self.layout, lm, self.dp_group)  # Trainer(sync_batchnorm=True)
        if is_parallelized_by_user(lm):  # by the user's configure_model, or by Cuboid in an earlier fit/validate
            self.fill_parallelized_by_user(lm, lm, self._pretrained())
        elif self.settings.replicate_if_it_fits and self.replicate_if_it_fits(lm, fault_tolerance=self.replicas):
            self.buffers, self.checkpointer.format = BufferBroadcast(False), self._replicated_format  # DDP's own
        else:
            with self.noting_build(lm):  # what the build hooks on, taken away again after the run (dropin.replicated)
                self._parallelize(lm, self._restored(trainer, lm))
        self.settle_for_libraries(trainer)  # a CheckpointIO plugin, weight averaging (cuboid.dropin.replicated)
        self._pretrained_loaded = True  # a later fit/validate on the same model keeps what it has learned
        self.checkpointer.make_group()
        self.job_guard.extra_group(self.checkpointer.group)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.job_guard.setup(trainer, fitting, self.checkpointer, self.distributed_sampler_kwargs, self.dp_mesh.size())
        self.model_to_device()
        self.buffers.setup(lm, self.dp_group)
        self.barrier()
        if fitting:
            self.optimizers, self.lr_scheduler_configs = [], []
            self.make_optimizers(trainer)  # (and the experts' bias on the routers' optimizer)
            capacity = self._device_capacity()
            if capacity is not None:  # with the optimizers' own state now: a layout that cannot fit, refused
                check_fits(lm, self.optimizers, capacity, f"The layout {self.layout.describe()}")
        self.setup_precision_plugin()
        if fitting:
            compat.optimizers_to_device(self.optimizers, self.root_device)
        if fitting and self.replicas is not None:  # torchft's manager and the gradient average over groups
            roots = [lm, *(stage.submod for stage in getattr(self.pipelining.runner, "stages", ()))]  # pp: stages too
            self.replicas.start(trainer, roots, self.checkpointer.position, self.distributed_sampler_kwargs, self.root_device)  # fmt: skip

    def _pretrained(self) -> Mapping[str, Any]:  # the first fit's only: a later one keeps what it learned
        return {} if self._pretrained_loaded else self.settings.pretrained

    def _parallelize(self, lm: pl.LightningModule, restored: set[str]) -> None:
        """Choose the route: a pipelined build keeps this rank's stages and parallelizes each, a plain one the whole
        module. Weights are prepared before either, filled once sharded (``restored``: a checkpoint fills them)."""
        matched = resolve_plan(lm, self.settings.tensor_parallel_plan, self.layout.tp)
        matched, self.loss_parallel.enabled = with_loss_parallel(matched, self.layout.pp, self.layout.cp)
        mesh, pipelined = self.device_mesh, self.pipelining.enabled
        if pipelined:  # positions in a Lightning optimizer state follow the whole model's order
            self.pipelining.check_module(lm)
            self.checkpointer.model_order = [name for name, _ in lm.named_parameters()]
        lm = self.precision_plugin.convert_module(lm)
        blocks = find_blocks(lm, self.settings.block_container)
        self.fit_estimate = estimate_fit(lm, self.layout, matched, blocks, self.pipelining)
        capacity = self._device_capacity()
        if capacity is not None:  # parameters and gradients alone cannot fit: refused before any allocation
            refuse_if_too_big(self.fit_estimate, self.layout, capacity, self.settings.dp_shard_auto)
        mp_policy, pretrained = self.precision_plugin.mixed_precision_policy, self._pretrained()
        if pipelined:  # this rank's stages, each parallelized by the pipeline, between the build's two halves
            weights, settings = self.prepare_build(lm, mp_policy, pretrained, restored, pipelined=True)
            stages = self.pipelining.build_stages(lm, blocks, matched, settings, mesh)
            self.finish_build(lm, weights, blocks)
            self.pipelining.build_schedule(stages, mesh, self.root_device, self.context)
        else:
            self.build_model(lm, blocks, matched, mp_policy, pretrained, restored)
        self.hook_step(lm, blocks, runner=self.pipelining.runner)  # under pp, the runner cuts the schedule's inputs
        self.describe_build(blocks, matched, f", {self.pipelining.describe()}" if pipelined else "")

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` builds on the meta device; Cuboid materializes shards in ``setup``."""
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    def _plain_step(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        self.buffers.sync()
        with self.context.step(), self.load_balancing.step(), self.loss_parallel.step(self.lightning_module):
            return plain_output(step(*args, **kwargs))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp > 1 the schedule runs forward and backward of every microbatch; the loss returned (the
        microbatch mean) is the same on every rank."""
        if self.replicas is not None:
            self.replicas.begin_step()
        if not self.pipelining.enabled:
            return self._plain_step(super().training_step, *args, **kwargs)
        batch, batch_idx = batch_and_index(args, kwargs)
        lm = self.lightning_module
        self.buffers.sync()
        with self.context.step(), self.load_balancing.step(), self.loss_parallel.step(lm, log=False):
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
        return self._eval_step("validation_step", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipelining.enabled:  # every rank of the pp group returns the last stage's predictions
            return self._eval_step("predict_step", super().predict_step, args, kwargs)
        self.buffers.sync()
        return super().predict_step(*args, **kwargs)

    def _eval_step(self, hook: str, step: Any, args: tuple, kwargs: dict) -> Any:
        if not self.pipelining.enabled:
            return self._plain_step(step, *args, **kwargs)
        batch, idx = batch_and_index(args, kwargs)
        lm, precision = self.lightning_module, self.precision_plugin
        self.buffers.sync()
        with self.context.step(), self.load_balancing.step(), self.loss_parallel.step(lm, log=False):
            return self.pipelining.eval_step(lm, hook, batch, idx, precision, self.root_device)

    @override
    def on_train_start(self) -> None:
        if self.pipelining.enabled:
            self.pipelining.check_loader(self.lightning_module.trainer.train_dataloader)

    @override
    def teardown(self) -> None:
        self.job_guard.teardown()  # first: a peer that finishes earlier must not look dead
        self.checkpointer.wait(raise_error=False)  # a failed background save was raised at the step after it
        self.job_guard.after_teardown()
        if self.replicas is not None:
            self.replicas.close()
        self.end_run()  # the model as Lightning's DDP leaves it: plain, on the CPU (cuboid.dropin.after_run)
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Cuboid: FSDP2, tp, pp, cp and ep on one mesh")
