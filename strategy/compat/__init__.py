"""The one door to other libraries' internals.

Every private name of lightning, torch, torchmetrics and transformers that Cuboid relies on is imported
or touched here (this package: torch.distributed's in ``compat/distributed.py``, the attention kernels that return
their log-sum-exp in ``compat/attention.py``, litdata's ``StreamingDataset`` ranks and Lightning's worker seeding in ``compat/data.py``, fake tensors in ``tracing.py``,
which forward runs and torch's Muon iteration in ``steps.py``, all
re-exported below), and nowhere else, each with what it is for and why no public API serves. Checked on:
lightning 2.5.0 and 2.6.6, torch 2.13.0, torchmetrics 1.4.0 and 1.9.0, transformers 5.24.0.
``tests/test_compat.py`` pins the behaviour each one is used for (and runs in CI's floor-version job
too), so an upgrade that changes one fails there, not silently in users' runs.

Hooks that Lightning itself calls by private names are part of writing a Strategy and are not listed
as uses: ``Strategy._configure_launcher`` / ``_launcher`` and ``_precision_plugin`` (overridden and set
in strategy.py as Lightning's own strategies do), Fabric's ``_precision`` and ``_backward_sync_control`` (an object
with ``no_backward_sync(module, enabled)``, set in fabric/strategy.py), and torch's ``ParallelStyle._apply`` (the method a
custom tensor-parallel style implements, in tp_styles.py).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

# --- lightning -----------------------------------------------------------------------------------------------
# isort: off
# Creating the default process group from a ClusterEnvironment (MASTER_ADDR/PORT, rank, world size, and the
# NCCL teardown at exit), exactly as Lightning's own strategies do.
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection  # noqa: F401

# All-reduce used by Strategy.reduce / self.log(sync_dist=True): kept identical to Lightning's semantics
# (mean on gloo as sum / size, in place).
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available  # noqa: F401

# Materializing a configure_model that parallelized by hand on the meta device (reset_parameters per module),
# as ModelParallelStrategy does.
from lightning.fabric.utilities.init import _materialize_distributed_module as materialize_distributed_module  # noqa: F401

# Each process's intra-op threads, the host's cores over the node's processes, unless OMP_NUM_THREADS says: what
# Lightning's script launcher does in every process it runs (its DDP keeps one launcher in each); Cuboid's children
# and external launches (SLURM's srun) run without one.
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed  # noqa: F401

# Per-rank RNG states in checkpoints, in the layout Lightning's own checkpoints use.
from lightning.fabric.utilities.seed import _collect_rng_states as collect_rng_states  # noqa: F401
from lightning.fabric.utilities.seed import _set_rng_states as set_rng_states  # noqa: F401

# The child-process command and the script launcher Cuboid's sweep-safe launcher extends (no public launcher API).
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd as basic_subprocess_cmd  # noqa: F401
from lightning.pytorch.strategies.launchers.subprocess_script import (  # noqa: F401
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

# Fabric's script launcher (``fabric.launch()`` re-runs the script per local rank), as its own strategies use it.
from lightning.fabric.strategies.launchers.subprocess_script import (  # noqa: F401
    _SubprocessScriptLauncher as FabricSubprocessScriptLauncher,
)
# isort: on


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move optimizer state to ``device`` (``step`` stays where the optimizer keeps it), as Lightning's private
    ``_optimizers_to_device`` does."""
    for opt in optimizers:
        for state in opt.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(device)


def set_module_device_mesh(lightning_module: Any, mesh: Any) -> None:
    """``LightningModule.device_mesh`` reads ``_device_mesh``; ModelParallelStrategy sets it the same way."""
    lightning_module._device_mesh = mesh


def route_link_checkpoint(callback: Any, link: Callable[[Any, str, str], None]) -> None:
    """Make ``ModelCheckpoint(save_last="link")`` update ``last`` through ``link(trainer, filepath, linkpath)``.

    ModelCheckpoint has no public hook for how it links ``last``; its ``_link_checkpoint`` (deletes, then
    symlinks) is replaced on the callback instance."""
    if not callable(getattr(type(callback), "_link_checkpoint", None)):
        raise RuntimeError(
            "This Lightning version's ModelCheckpoint has no _link_checkpoint; Cuboid cannot make save_last='link' "
            "safe. Use save_last=True (an atomic copy) instead."
        )
    callback._link_checkpoint = link


def should_accumulate(trainer: Any) -> bool:
    """Whether this batch only accumulates gradients (no optimizer step follows): the fit loop's own answer."""
    return trainer.fit_loop._should_accumulate()


def train_batch_is_last(trainer: Any) -> bool:
    """Whether the training batch about to run is its loader's last (Lightning's fetcher looks one batch ahead)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def end_train_epoch_after_this_batch(trainer: Any) -> None:
    """Make the batch about to run the epoch's last, as if the loader ended after it: the fit loop then steps the
    optimizer, validates and ends the epoch as it does at a loader's real end (``_num_ready_batches_reached`` reads
    this flag). No public setter exists; the attribute is the one Lightning's own loop sets before each batch."""
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


def evaluation_batch_is_last(trainer: Any) -> bool:
    """Whether the validation/test/predict batch about to run is its loader's last (``Trainer._evaluation_loop``,
    or the predict loop)."""
    loop = trainer.predict_loop if trainer.predicting else trainer._evaluation_loop
    return bool(loop.batch_progress.is_last_batch)


def drop_sigterm_broadcast(trainer: Any) -> None:
    """Stop Lightning's training loop (2.6) from broadcasting rank 0's SIGTERM flag at the start of every step of a
    distributed run (``_TrainingEpochLoop._broadcast_sigterm_tensor``: a device tensor read back with ``.item()``,
    a host sync per step on GPUs); Cuboid agrees on it through host memory instead. Lightning 2.5 has no such
    broadcast. No public switch exists; set on this trainer's loop only."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


def take_over_sigterm(trainer: Any, on_signal: Callable[[], None]) -> Callable[[], None]:
    """Make Lightning's SIGTERM handler call ``on_signal`` (and pass the signal to processes its launcher started)
    instead of setting ``trainer.received_sigterm``; returns a function that sets it. Lightning 2.6's handler
    (``_SignalConnector._sigterm_notifier_fn``) broadcasts a tensor from inside the signal handler (a collective
    at a different point on each rank), and its loops raise at the end of the signalled rank's step on their own,
    while the other ranks wait in the next step's collectives. Must run before the Trainer registers its
    handlers (it does so after ``Strategy.setup``)."""
    connector = trainer._signal_connector

    def notify(signum: Any, frame: Any) -> None:
        if trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        on_signal()

    def mark() -> None:
        connector.received_sigterm = True

    connector._sigterm_notifier_fn = notify
    return mark


def take_over_slurm_requeue_signal(trainer: Any, on_signal: Callable[[], None]) -> None:
    """Make Lightning's SLURM auto-requeue handler (``_SignalConnector._slurm_sigusr_handler_fn``, registered for
    SIGUSR1 under SLURM) call ``on_signal`` instead of saving a checkpoint from inside the signal handler, at a
    different point on each rank. Must run before the Trainer registers its handlers."""

    def notify(signum: Any, frame: Any) -> None:
        on_signal()

    trainer._signal_connector._slurm_sigusr_handler_fn = notify


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()  # pending_checkpoint could not tell


def give_back_signals(trainer: Any) -> None:
    """Undo :func:`drop_sigterm_broadcast`, :func:`take_over_sigterm`, :func:`take_over_slurm_requeue_signal` once a
    fit ends: Lightning's own methods again on ``trainer`` (which then pickles: the functions set were local ones)."""
    signals = trainer._signal_connector
    for owner, name in ((trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"), (signals, "_sigterm_notifier_fn"),
                        (signals, "_slurm_sigusr_handler_fn")):  # fmt: skip
        vars(owner).pop(name, None)


def pending_checkpoint(trainer: Any) -> Any:
    """The checkpoint the running ``fit``/``validate``/``test``/``predict`` of ``trainer`` will restore once the
    strategy is set up: a path, ``None`` when it restores none, or :data:`UNKNOWN` when this Lightning does not let
    it be found (callers then act as if a checkpoint may not come). Lightning resolves ``ckpt_path`` (``"last"``,
    ``"hpc"``, a registry name) before ``Trainer._run`` and keeps it in that call's argument until
    ``_restore_modules_and_callbacks`` hands it to ``Strategy.load_checkpoint``, after ``Strategy.setup``; no
    public attribute holds it before then (``trainer.ckpt_path`` is set only at the restore). Read from the frame
    of ``Trainer._run`` for this trainer on the current call stack."""
    import sys

    run = getattr(type(trainer), "_run", None)
    code = getattr(run, "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path", UNKNOWN)
        frame = frame.f_back
    return UNKNOWN


def requested_weights_only() -> bool | None:
    """The ``weights_only`` the user passed to ``trainer.fit/validate/test/predict``. Lightning 2.5-2.6 drops it for a
    strategy that restores after setup (``Trainer._run``: ``_restore_modules_and_callbacks(ckpt_path)``, without
    it: Lightning's own FSDP and ModelParallel strategies are served the same), so ``load_checkpoint`` receives
    None; it is read from ``_run``'s frame, the caller above. None where there is none (pinned in
    tests/test_compat.py, which says when Lightning passes it on)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_globals.get("__name__", "").endswith("trainer.trainer"):
            return frame.f_locals.get("weights_only")
        frame = frame.f_back
    return None


# --- torch -----------------------------------------------------------------------------------------------------


def is_view_of(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view made from ``base`` (``Tensor._base``). A pipeline schedule hands the loss
    function views of the target it was given (``tensor_split``) for real microbatches, and a detached copy of
    one for its metadata inference, which runs the last stage on uninitialized inputs: no public flag says
    which call is which."""
    return tensor._base is base


def torch_function_modes() -> list[Any]:
    """The ``TorchFunctionMode`` stack now active, outermost first. ``torch.overrides`` has no public reader of it in
    torch 2.13; activation checkpointing needs it because the autograd engine runs a recompute without the modes
    its forward ran under (pinned in tests/test_compat.py)."""
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def module_apply(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> None:
    """Apply ``fn`` to every tensor a module keeps (its own only, with ``recurse=False``), through
    ``nn.Module._apply``: what ``to`` and ``to_empty`` use, and what FSDP2 (re-registers its sharded parameters) and
    torchmetrics (moves states and defaults) override. Needed to materialize only some tensors (the meta ones)."""
    if recurse:
        module._apply(fn)  # torchmetrics' Metric._apply takes no ``recurse``
    else:
        module._apply(fn, recurse=False)


def swap_parameter(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put a plain tensor (e.g. a DTensor's local shard) where a parameter is registered, for one forward.
    ``setattr`` refuses a non-Parameter there; FSDP2 installs its unsharded parameters the same way."""
    module._parameters[name] = value  # type: ignore[assignment]


def shallow_module_copy(module: nn.Module) -> nn.Module:
    """A module sharing ``module``'s children, parameters and buffers, whose own child slots can be changed without
    touching the original (pipeline stages are such views)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


class RepeatableRecompute:
    """torch's selective-checkpoint recompute mode (the second of ``create_selective_checkpoint_contexts``), for a
    forward recomputed more than once: a zero-bubble pipeline schedule runs a stage's backward as two autograd
    calls (its input gradients, then its weights'), and each recomputes the checkpointed block. torch's mode hands
    out each saved op output once and refuses a second recompute ("backward an extra time"); this one puts the
    outputs it handed out back in its cache (``storage``, private: pinned in tests/test_compat.py) when a recompute
    ends. Nothing is copied; the cache is freed with the block's autograd graph, as before."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self.kept: dict[Any, Any] = {}

    def __enter__(self) -> Any:
        # per op, its saved outputs (a list torch 2.11 pops, a dict by call index torch 2.13 marks consumed)
        self.kept = {key: copy.copy(entries) for key, entries in self.mode.storage.items()}
        return self.mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.mode.__exit__(*exc)
        finally:
            self.mode.storage.update(self.kept)
            self.kept = {}


# Attention ops whose outputs selective activation checkpointing keeps (aten overloads, named as torch names them):
# every fused kernel scaled_dot_product_attention can choose (torch's _fused_sdp_choice: flash, memory-efficient,
# cuDNN, which torch prefers on Hopper with recent cuDNN, the CPU flash kernel, and the one other backends override),
# so that backward never recomputes attention. The math path has no single op to keep.
SDPA_OPS = (
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
)

# --- torchmetrics ----------------------------------------------------------------------------------------------


def set_metric_update_count(metric: Any, count: int) -> None:
    """Give a metric whose states were copied in from another rank the update count that came with them, and
    drop its cached result, so ``compute()`` neither warns nor returns a stale value. ``Metric.update_count`` is
    read-only; there is no public way to clear ``_computed``."""
    metric._update_count = count
    metric._computed = None


# --- transformers ----------------------------------------------------------------------------------------------


def reads_kv_cache_only(module: nn.Module) -> bool:
    """transformers' flag for a decoder layer that only reads its KV cache, which may therefore keep it under
    gradient checkpointing (``GradientCheckpointingLayer._can_checkpoint_with_cache``)."""
    return bool(getattr(module, "_can_checkpoint_with_cache", False))


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """Multiply every tensor in place by one 0-d tensor in a few fused kernels (``torch._foreach_mul_``, what
    ``torch.nn.utils.clip_grads_with_norm_`` uses; that one takes parameters, whose DTensor gradients of different
    meshes it cannot combine)."""
    torch._foreach_mul_(tensors, scalar)


def tensor_version(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` was changed in place (autograd's version counter, ``Tensor._version``; no public
    twin in torch 2.11 or 2.13). Read on the host, never a device value: how the buffer broadcast tells which
    buffers a step changed without a collective (pinned in tests/test_compat.py)."""
    return tensor._version


def layer_sync(strategy: Any) -> Any:
    """What ``Trainer(sync_batchnorm=True)`` (or a ``LayerSync`` plugin) asked the strategy for: Lightning's
    accelerator connector sets it on ``Strategy._layer_sync`` (lightning 2.5 and 2.6), which DDP and FSDP read in
    ``setup``; ``None`` when not asked (pinned in tests/test_compat.py)."""
    return getattr(strategy, "_layer_sync", None)


# --- attention kernels with their log-sum-exp: cuboid/compat/attention.py ---------------------------------------
from cuboid.compat.attention import (  # noqa: E402, F401
    BlockShape,
    KernelUnavailable,
    lse_attention,
    lse_attention_backward,
    lse_kernel,
    window_mask,
)
from cuboid.compat.callbacks import averaged_copies  # noqa: E402, F401  (weight averaging's whole copy)
from cuboid.compat.contracts import CudaContractError, CudaContracts  # noqa: E402, F401  (CUDA's preconditions)

# --- litdata's StreamingDataset, Lightning's DataLoader workers and samplers: cuboid/compat/data.py ------------------
from cuboid.compat.data import (  # noqa: E402, F401
    batch_per_sample,
    deal_over_data_parallel,
    seed_workers_by_data_rank,
    set_sampler_epoch,
    train_data,
    update_dataloader,
    wrapped_sampler,
)

# --- torch.distributed: cuboid/compat/distributed.py -------------------------------------------------------------
from cuboid.compat.distributed import (  # noqa: E402, F401  (the torch.distributed half of this door)
    PointToPointCounter,
    all_gather_single,
    default_process_group_backend,
    default_store,
    distributed_is_initialized,
    flatten_mesh,
    flight_recorder_dump,
    flight_recorder_entries,
    fsdp_unreduced,
    fsspec_reader,
    fsspec_writer,
    full_tensor,
    init_fake_process_group,
    name_mesh,
    on_group_device,
    reduce_scatter_single,
    set_group_timeout,
    start_dtensor_rng,
    unflatten_mesh,
)
from cuboid.compat.fsdp import MIXED_TENSORS, drop_hooks, fsdp_units, hook_keys, unshard_for_good  # noqa: E402, F401
from cuboid.compat.hf import saved_names  # noqa: E402, F401  (transformers' saved names of a model's own)
from cuboid.compat.steps import (  # noqa: E402, F401  (which forward runs; torch's Muon iteration)
    counted_forward,
    in_backward,
    muon_newton_schulz,
    unhooked_step,
    watch_metadata_inference,
)
from cuboid.compat.tracing import LiveBytes, RealData, StepMemory, fake_mode, track_memory  # noqa: E402, F401
