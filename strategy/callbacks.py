"""Cuboid's callbacks: :class:`CuboidMonitor`, per-step training telemetry (global grad norm, tokens/s, FLOP/s,
MFU and peak memory per rank), and :class:`~cuboid.measure.CommLedger`, the communication ledger.

Values are global, so every rank computes the same number and logs it once (rank 0's logger).
Tokens/s counts data-parallel ranks only: tensor- and pipeline-parallel peers see the same
tokens (Lightning's ThroughputMonitor multiplies by the world size instead).
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from cuboid.compat import should_accumulate
from cuboid.experts import ExpertLoad
from cuboid.measure import CommLedger
from cuboid.parallel import dim_groups
from cuboid.step import global_grad_norm

__all__ = ["CommLedger", "CuboidMonitor", "device_peak_flops", "peak_flops", "peak_memory_bytes"]

# Dense peak FLOP/s by device model and math (NVIDIA datasheets, without sparsity), most specific name first.
# MFU is reported only where the model is known; "tf32" applies to fp32 runs with TF32 matmuls allowed.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "H100": {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12},  # SXM
    "H200 NVL": {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12},  # SXM
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}


def peak_flops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """Peak dense FLOP/s of a GPU model (``torch.cuda.get_device_name``) for a Lightning precision: the bf16 or
    fp16 tensor-core peak for ``*-mixed``/``*-true`` half precisions, TF32 or plain fp32 for ``32-true``."""
    math_kind = "bf16" if precision.startswith(("bf16", "16")) else ("tf32" if tf32 else "fp32")
    for key, peaks in PEAK_FLOPS.items():
        if key in device_name:
            return peaks[math_kind]
    return None


def device_peak_flops(device: torch.device, precision: str = "bf16-mixed") -> float | None:
    if device.type != "cuda":
        return None
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return peak_flops(torch.cuda.get_device_name(device), precision, tf32)


def _data_groups(strategy: Any) -> list[dist.ProcessGroup]:
    """The groups whose ranks read different tokens: data parallel (replicas x shards, the mesh's flattened
    ``dp``) and context parallel; the world under a strategy without Cuboid's mesh."""
    mesh = getattr(strategy, "device_mesh", None)
    if mesh is None:
        return [dist.group.WORLD] if dist.is_initialized() else []
    return [group for _, group in dim_groups(mesh, ("dp", "cp")) if group.size() > 1]


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on a GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


class CuboidMonitor(L.Callback):
    """Log ``train/grad_norm``, ``perf/tokens_per_s``, ``perf/flops_per_s``, ``perf/mfu`` (GPU with a
    known peak) and ``perf/peak_mem_gb`` (max over ranks) every ``trainer.log_every_n_steps``. On a
    mixture-of-experts model, also the step's expert load (``moe/tokens_per_expert_max``, ``_mean``,
    ``moe/load_imbalance``, ``moe/idle_experts``: :mod:`cuboid.experts.load`), counted on logging steps only.

    Token and FLOP counts come from the LightningModule's ``tokens_in_batch(batch)`` and
    ``flops_per_token(seq_len)`` when it has them (``cuboid.models.CausalLM`` does).
    """

    def __init__(self) -> None:
        self._t_last: float | None = None
        self._tokens = 0
        self._seq_len = 0
        self._pending_norm: torch.Tensor | None = None  # measured before the step when not clipping
        self._load: ExpertLoad | None = None
        self._skip_first = False

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        load = ExpertLoad(pl_module)
        self._load = load if len(load) else None
        pipelining = getattr(trainer.strategy, "pipelining", None)
        # The first pipelined batch also runs each stage's shape inference (a forward of made-up inputs): no
        # load figures from it.
        self._skip_first = bool(getattr(pipelining, "enabled", False))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._load is not None:
            self._load.remove()
            self._load = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._t_last is None:
            self._t_last = time.perf_counter()
        count = getattr(pl_module, "tokens_in_batch", None)
        if count is not None and torch.is_tensor(batch):
            self._tokens += count(batch)
            self._seq_len = batch.shape[1] - 1
        if self._load is not None:  # the forward passes of a step that logs (every microbatch of it)
            self._load.on = self._log_now(trainer) and not self._skip_first
            self._skip_first = False

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._load is not None:  # an activation-checkpointing recompute in backward is not counted again
            self._load.on = False

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self._log_now(trainer):
            return
        if not trainer.gradient_clip_val:  # no clipping: measure the norm here (all ranks take part)
            dims = getattr(trainer.strategy, "dims", None)  # Cuboid's; Lightning's ModelParallelStrategy: its mesh
            mesh = dims.mesh if dims is not None and dims.built else getattr(trainer.strategy, "_device_mesh", None)
            flattened = getattr(trainer.precision_plugin, "flattened_dims", {})
            elsewhere = getattr(trainer.precision_plugin, "counted_elsewhere", ())
            self._pending_norm = global_grad_norm(pl_module.parameters(), mesh, flattened, elsewhere)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._load is not None:
            self._load.on = False
        if not should_accumulate(trainer) and self._log_now(trainer, after_step=True):
            self._log(trainer, pl_module)

    def _log_now(self, trainer: L.Trainer, after_step: bool = False) -> bool:
        step = trainer.global_step - (1 if after_step else 0)
        return step % max(1, trainer.log_every_n_steps) == 0

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        elapsed = now - (self._t_last or now)
        self._t_last = now
        strategy = trainer.strategy
        dp_size = strategy.dp_mesh.size() if hasattr(strategy, "dp_mesh") else trainer.world_size
        metrics: dict[str, float] = {}
        stats = torch.tensor([float(peak_memory_bytes(device)), elapsed], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # slowest rank's time, largest peak
        metrics["perf/peak_mem_gb"] = float(stats[0]) / 2**30
        elapsed = float(stats[1])
        if self._tokens and elapsed > 0:
            tokens_per_s = self._tokens * dp_size / elapsed
            metrics["perf/tokens_per_s"] = tokens_per_s
            flops = getattr(pl_module, "flops_per_token", None)
            if flops is not None:
                flops_per_s = flops(self._seq_len) * tokens_per_s
                metrics["perf/flops_per_s"] = flops_per_s
                peak = device_peak_flops(device, str(trainer.precision))
                if peak is not None:
                    metrics["perf/mfu"] = flops_per_s / (peak * trainer.world_size)
        self._tokens = 0
        norm = self._pending_norm
        if trainer.gradient_clip_val:  # clipping measured it, after on_before_optimizer_step
            norm = getattr(trainer.precision_plugin, "last_grad_norm", None)
        if norm is not None:
            metrics["train/grad_norm"] = float(norm)
            self._pending_norm = None
        if self._load is not None:
            metrics.update(self._load.take(_data_groups(strategy)) or {})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
