"""One-GPU checks and figures, run by ``scripts/bench_gpu.sh`` (each subcommand is one PASS/FAIL line there).

    python scripts/bench/gpu.py env                                    # torch, CUDA, cuDNN, the device, versions
    python scripts/bench/gpu.py sync_audit --model 1b --seq 2048       # host syncs in quiet steps, with their stacks
    python scripts/bench/gpu.py throughput --model 1b --seq 2048 --batch 4 [--compile] [--ac selective]
    python scripts/bench/gpu.py attention --seq 8192 --cp 4            # the kernel SDPA picks for cp's shapes,
                                                                       # and cp's block attention against it
    python scripts/bench/gpu.py weights --model 8b --init local        # making a meta-built model's weights
    python scripts/bench/gpu.py resume --model 150m [--async-save]     # save at an epoch end, resume, compare
    python scripts/bench/gpu.py offload --model 150m                   # cpu_offload + meta init + clipping

Each prints one JSON line (prefixed ``RESULT``) and exits non-zero when its check fails. Every run builds the
model on the meta device (``CausalLM(meta_init=True)``), trains with ``CuboidStrategy`` in bf16-mixed (the
default here) on one process. ``--accelerator cpu --model debug`` runs the same logic on a CPU, for trying the
script itself (no MFU: no known peak).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.callbacks import device_peak_flops, peak_memory_bytes
from cuboid.models import CausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import SetupClock, SetupMeasured  # noqa: E402  (scripts/bench: what the suites share)


def tokens(n: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))


class StepClock(L.Callback):
    """Time of the steps after ``warmup``: on a GPU two CUDA events (at the start of step ``warmup`` and at the end of
    the last step) and one synchronization when training ends, so no step waits for the device; elsewhere the host's
    clock."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.steps, self.seconds = warmup, 0, float("nan")
        self._start: Any = None
        self._end: Any = None
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.warmup and self._start is None:
            if module.device.type == "cuda":
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            else:
                self._start, self._t0 = True, time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.steps = trainer.global_step - self.warmup
            if module.device.type == "cuda":
                self._end = self._end or torch.cuda.Event(enable_timing=True)
                self._end.record()
            else:
                self.seconds = time.perf_counter() - self._t0

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if module.device.type == "cuda" and self._end is not None:
            torch.cuda.synchronize(module.device)  # the one synchronization
            self.seconds = self._start.elapsed_time(self._end) / 1000


def timed(fn: Any, repeat: int, device: torch.device) -> float:
    """Milliseconds per call of ``fn`` (after two calls to warm up): CUDA events around ``repeat`` calls and one
    synchronization at the end on a GPU, the host's clock elsewhere."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) / repeat * 1000
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / repeat


class Losses(L.Callback):
    """Every step's logged loss (the run logs every step)."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        value = trainer.callback_metrics.get("train/loss")
        if value is not None:
            self.by_step[trainer.global_step] = float(value)


def trainer_for(args: argparse.Namespace, strategy: CuboidStrategy, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": args.accelerator,
        "devices": 1,
        "precision": args.precision,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    module = CausalLM(model=args.model, meta_init=True, warmup_steps=2, max_steps=args.steps)
    clock = StepClock(args.warmup)
    strategy = CuboidStrategy(compile=args.compile, activation_checkpointing=args.ac)
    trainer = trainer_for(args, strategy, max_steps=args.steps, callbacks=[clock], log_every_n_steps=args.steps)
    data = tokens(args.batch * args.steps, args.seq, module.cfg.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    step_s = clock.seconds / max(1, clock.steps)
    tokens_per_s = args.batch * args.seq / step_s
    flops_per_s = module.flops_per_token(args.seq) * tokens_per_s
    peak = device_peak_flops(module.device, args.precision)
    return {
        "check": "throughput",
        "model": args.model,
        "params": sum(p.numel() for p in module.parameters()),
        "matmul_params": module.cfg.matmul_params(),
        "seq": args.seq,
        "batch": args.batch,
        "compile": args.compile,
        "ac": args.ac,
        "precision": args.precision,
        "step_ms": round(step_s * 1000, 2),
        "tokens_per_s": round(tokens_per_s),
        "mfu": None if peak is None else round(flops_per_s / peak, 4),
        "peak_mem_gib": round(peak_memory_bytes(module.device) / 2**30, 2),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "ok": math.isfinite(step_s) and clock.steps > 0,
    }


def resume(args: argparse.Namespace) -> dict[str, Any]:
    """Two epochs straight; then one epoch, a checkpoint at its end, and a resume for the second: the second
    epoch's losses must match (same data order: no shuffling)."""
    per_epoch = 5
    batches = args.batch * per_epoch
    vocab = CausalLM(model=args.model).cfg.vocab_size
    loader = DataLoader(tokens(batches, args.seq, vocab), batch_size=args.batch)

    def run(epochs: int, ckpt_dir: Path | None, ckpt_path: str | None) -> Losses:
        L.seed_everything(0, verbose=False)
        module = CausalLM(model=args.model, meta_init=True, warmup_steps=2, max_steps=2 * per_epoch)
        losses = Losses()
        callbacks: list[L.Callback] = [losses]
        if ckpt_dir is not None:
            callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1))
        strategy = CuboidStrategy(async_checkpoint=args.async_save)
        trainer = trainer_for(
            args, strategy, max_epochs=epochs, callbacks=callbacks, log_every_n_steps=1,
            enable_checkpointing=ckpt_dir is not None,
        )  # fmt: skip
        started = time.perf_counter()
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        losses.seconds = time.perf_counter() - started  # type: ignore[attr-defined]
        return losses

    with tempfile.TemporaryDirectory() as tmp:
        straight = run(2, None, None)
        first = run(1, Path(tmp), None)
        saved = sorted(Path(tmp).glob("*.ckpt"))
        second = run(2, None, str(saved[-1])) if saved else Losses()
    steps = range(per_epoch + 1, 2 * per_epoch + 1)
    diffs = [abs(second.by_step[s] - straight.by_step[s]) for s in steps if s in second.by_step]
    return {
        "check": "resume",
        "model": args.model,
        "async_save": args.async_save,
        "checkpoint": saved[-1].name if saved else None,
        "first_epoch_s": round(first.seconds, 2),  # type: ignore[attr-defined]
        "losses_straight": [round(straight.by_step[s], 4) for s in steps],
        "losses_resumed": [round(second.by_step.get(s, float("nan")), 4) for s in steps],
        "max_abs_diff": max(diffs) if diffs else None,
        # bf16-mixed on a GPU is not bitwise deterministic (atomics in attention's backward): a loose bound.
        "ok": bool(saved) and len(diffs) == per_epoch and max(diffs) < 2e-2,
    }


def offload(args: argparse.Namespace) -> dict[str, Any]:
    """cpu_offload=True with meta init and gradient clipping: shards live on the host, steps run on the GPU; then a
    full-format save (whole tensors gathered from host shards: no host tensor may reach the NCCL group, issue 67's
    item 4) read back with torch.load."""
    module = CausalLM(model=args.model, meta_init=True, warmup_steps=2, max_steps=args.steps)
    losses = Losses()
    strategy = CuboidStrategy(cpu_offload=args.accelerator != "cpu", checkpoint_format="full")
    trainer = trainer_for(
        args, strategy, max_steps=args.steps, callbacks=[losses], log_every_n_steps=1, gradient_clip_val=1.0
    )
    data = tokens(args.batch * args.steps, args.seq, module.cfg.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    devices = sorted({str(p.device) for p in module.parameters()})
    values = [losses.by_step[s] for s in sorted(losses.by_step)]
    with tempfile.TemporaryDirectory() as folder:
        try:
            trainer.save_checkpoint(Path(folder) / "full.ckpt")
            saved = torch.load(Path(folder) / "full.ckpt", map_location="cpu", weights_only=False)["state_dict"]
            full_save = len(saved) == len(module.state_dict())
        except Exception as err:  # noqa: BLE001  (the check reports it)
            full_save = f"{type(err).__name__}: {err}"[:300]
    return {
        "full_save": full_save,
        "check": "offload",
        "model": args.model,
        "parameter_devices": devices,
        "losses": [round(v, 4) for v in values],
        "peak_mem_gib": round(peak_memory_bytes(module.device) / 2**30, 2),
        # (random tokens: the loss need not fall in a few steps) the shards stay on the host under offload
        "ok": len(values) == args.steps
        and all(math.isfinite(v) for v in values)
        and (args.accelerator == "cpu" or devices == ["cpu"])
        and full_save is True,
    }


def env(args: argparse.Namespace) -> dict[str, Any]:
    """What the machine has: Python, torch (its CUDA and cuDNN), the device, and the packages the main job needs."""
    import importlib

    import cuboid

    cuda = torch.cuda.is_available()
    found = {}
    for name in ("lightning", "transformers", "hydra", "omegaconf", "wandb", "peft"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "?")
        except ImportError:
            found[name] = None
    return {
        "check": "env",
        "python": sys.version.split()[0],
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cuboid": cuboid.__version__,
        **found,
        "ok": (cuda or args.accelerator == "cpu") and found["hydra"] is not None and found["wandb"] is not None,
    }


class SyncAudit(L.Callback):
    """Host syncs between the start of step ``first`` and the start of step ``last`` (quiet steps: no logging,
    no validation, no checkpoint), each with the stack that made it. On a GPU: torch's sync debug mode (every
    synchronizing CUDA call warns). On CPU, where nothing waits on a device: reads of a tensor's value on the host
    (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``float()``), seen by a dispatch mode, less AdamW's
    step counts (host tensors on GPUs too)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.found, self._on, self.host = first, last, [], None, set()

    def _record(self, what: str) -> None:
        import traceback

        frames = [f for f in traceback.extract_stack()[:-3] if "warnings" not in f.filename]
        self.found.append({"what": what, "stack": [f"{f.filename}:{f.lineno} {f.name}" for f in frames[-6:]]})

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.first and self._on is None:
            # AdamW's step counts live on the host on purpose (not capturable), also on GPUs: reading them is no sync
            self.host = {id(s["step"]) for o in trainer.optimizers for s in o.state.values() if "step" in s}
            self._start(module.device)
        elif trainer.global_step == self.last and self._on is not None:
            self._stop(module.device)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._on is not None:
            self._stop(module.device)

    def _start(self, device: torch.device) -> None:
        import warnings

        if device.type == "cuda":
            self._on = (warnings.showwarning, warnings.filters[:])
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *a, **k: self._record(str(message))
            torch.cuda.set_sync_debug_mode("warn")
            return
        from torch.utils._python_dispatch import TorchDispatchMode

        audit = self

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in audit.host:
                    audit._record("host read of a tensor value (.item())")
                return func(*args, **(kwargs or {}))

        self._on = Reads()
        self._on.__enter__()

    def _stop(self, device: torch.device) -> None:
        import warnings

        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning, warnings.filters[:] = self._on
        else:
            self._on.__exit__(None, None, None)
        self._on = None


def sync_audit(args: argparse.Namespace) -> dict[str, Any]:
    """Quiet steps of a meta-built model in bf16-mixed: 0 host syncs, or each one named with its stack."""
    module = CausalLM(model=args.model, meta_init=True, warmup_steps=2, max_steps=args.steps)
    audit = SyncAudit(args.warmup, args.steps - 1)
    trainer = trainer_for(args, CuboidStrategy(), max_steps=args.steps, callbacks=[audit], log_every_n_steps=args.steps)
    trainer.fit(module, DataLoader(tokens(args.batch * args.steps, args.seq, module.cfg.vocab_size), args.batch))
    return {
        "check": "sync_audit",
        "model": args.model,
        "steps_audited": args.steps - 1 - args.warmup,
        "syncs": len(audit.found),
        "first": audit.found[:5],
        "ok": not audit.found,
    }


# context parallel's attention cases: (name, padding, sliding window, sink, soft cap, dtype on a GPU)
ATTENTION_CASES = (
    ("causal", False, None, False, None, torch.bfloat16),
    ("padded", True, None, False, None, torch.bfloat16),
    ("window", False, 1000, False, None, torch.bfloat16),
    ("window_padded", True, 1000, False, None, torch.float16),
    ("sink", False, 1000, True, None, torch.bfloat16),
    # a window longer than a chunk (tokens - 3): chunk 1's lower-edge block has more rows than keys + 1, which
    # FlashAttention-2 reads otherwise than the plan states (issue 67, item 2: NaN there before the fix)
    ("window_long", False, -3, False, None, torch.bfloat16),
    ("softcap", False, None, False, 50.0, torch.bfloat16),
    ("fp32", False, None, False, None, torch.float32),
)


def attention(args: argparse.Namespace) -> dict[str, Any]:
    """Context parallel's block attention, each case on the kernel a GPU gives it (``cuboid.compat.lse_kernel``:
    FlashAttention-2 with its own window, the memory-efficient kernel with a block's bias for padding and fp32,
    FlexAttention for soft-capped scores), against attention written out in float32 over the same tokens (output
    and gradients), and its forward + backward time; beside it, the kernel ``scaled_dot_product_attention`` picks for
    the same block shapes. On one rank: its two query chunks of ``seq / cp`` tokens are the blocks a cp rank runs."""
    import os

    import torch.distributed as dist

    from cuboid import compat
    from cuboid.context.attention import cp_attention

    device = torch.device("cuda" if args.accelerator != "cpu" else "cpu")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29591")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    heads, kv_heads, dim = (32, 8, 128) if device.type == "cuda" else (4, 2, 16)
    tokens = args.seq // args.cp
    rows = []
    for name, padded, window, with_sink, softcap, gpu_dtype in ATTENTION_CASES:
        dtype = gpu_dtype if device.type == "cuda" else torch.float32
        window = None if window is None else (min(window, tokens // 3) if window > 0 else tokens + window)
        g = torch.Generator(device=device).manual_seed(len(rows))
        q = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype, generator=g).requires_grad_()
        k, v = (torch.randn(1, kv_heads, tokens, dim, device=device, dtype=dtype, generator=g).requires_grad_()
                for _ in range(2))  # fmt: skip
        grad = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype, generator=g)
        real = None
        if padded:
            real = torch.ones(1, tokens, dtype=torch.bool, device=device)
            real[:, : tokens // 8] = False  # left padding
        sink = torch.randn(heads, device=device, generator=g) if with_sink else None
        kernel = compat.lse_kernel(q, padded=padded, softcap=softcap is not None)

        def mine(q=q, k=k, v=v, real=real, window=window, sink=sink, softcap=softcap, grad=grad) -> list[torch.Tensor]:
            out = cp_attention(q, k, v, dist.group.WORLD, tokens, enable_gqa=True, key_padding=real, window=window,
                               sink=sink, softcap=softcap)  # fmt: skip
            return [out, *torch.autograd.grad(out, (q, k, v), grad)]

        def written(q=q, k=k, v=v, real=real, window=window, sink=sink, softcap=softcap, grad=grad) -> list:
            return _written_out_attention(q, k, v, grad, real, window, sink, softcap)

        got, want = mine(), written()
        worst = max(float((a.detach().float() - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True))
        del want
        bound = 1e-5 if dtype == torch.float32 else 3e-2
        rows.append({"case": name, "dtype": str(dtype).split(".")[-1], "kernel": kernel, "tokens": tokens,
                     "window": window, "max_rel_diff": worst, "blocks_ms": round(timed(mine, 3, device), 3),
                     "ok": worst <= bound})  # fmt: skip
    rows += _sdpa_picks(device, heads, kv_heads, dim, tokens // 2)
    return {"check": "attention", "seq": args.seq, "cp": args.cp, "rows": rows, "ok": all(r["ok"] for r in rows)}


def _written_out_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, real: Any, window: Any, sink: Any,
    softcap: Any,
) -> list[torch.Tensor]:  # fmt: skip
    """Causal attention written out in float32 (the reference): its output and the gradients of q, k, v."""
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    scores = q32 @ k32.repeat_interleave(groups, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    n = q.shape[2]
    seen = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        seen &= ~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-window)
    if real is not None:
        seen = seen & real[:, None, None, :]
    scores = scores.masked_fill(~seen, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = probs[..., :n] @ v32.repeat_interleave(groups, 1)
    return [out.detach(), *torch.autograd.grad(out, (q32, k32, v32), grad.float())]


def _sdpa_picks(device: torch.device, heads: int, kv_heads: int, dim: int, chunk: int) -> list[dict[str, Any]]:
    """The kernel ``scaled_dot_product_attention`` picks for a cp block's shapes (a chunk's causal diagonal; a chunk
    against earlier keys, unmasked), with and without grouped-query heads, and its forward + backward time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    picked: list[str] = []

    class Kernel(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name.startswith("_scaled_dot_product") and "backward" not in name:
                picked.append(name)
            return func(*a, **(kwargs or {}))

    rows = []
    for causal, gqa in ((True, False), (True, True), (False, True)):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, heads, chunk, dim, device=device, dtype=dtype, generator=g, requires_grad=True)
        k, v = (torch.randn(1, kv_heads if gqa else heads, 2 * chunk if not causal else chunk, dim, device=device,
                            dtype=dtype, generator=g, requires_grad=True) for _ in range(2))  # fmt: skip

        def step(q=q, k=k, v=v, causal=causal, gqa=gqa) -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa).sum().backward()

        picked.clear()
        with Kernel():
            step()
        rows.append({"sdpa": True, "causal": causal, "gqa": gqa, "q_tokens": chunk, "keys": k.shape[2],
                     "kernel": picked[0] if picked else "math", "ms": round(timed(step, 3, device), 3), "ok": True})  # fmt: skip
    return rows


def weights(args: argparse.Namespace) -> dict[str, Any]:
    """Making a meta-built model's weights, set-up included (to the first step, which never runs): ``--init
    local`` (each rank initializes its shards on the device) or ``rank0`` (rank 0's host init, sent)."""
    module = CausalLM(model=args.model, meta_init=True)
    clock = SetupClock(stop=True)
    strategy = CuboidStrategy(weights_init=args.init)
    trainer = trainer_for(args, strategy, max_steps=1, callbacks=[clock])
    try:
        trainer.fit(module, DataLoader(tokens(1, 16, module.cfg.vocab_size), batch_size=1))
    except SetupMeasured:
        pass
    return {
        "check": "weights",
        "model": args.model,
        "init": args.init,
        "params": sum(p.numel() for p in module.parameters()),
        "setup_s": round(clock.seconds, 2),
        "pieces_initialized": strategy.weights_made.get("initialized"),
        "peak_mem_gib": round(peak_memory_bytes(module.device) / 2**30, 2),
        "ok": bool(strategy.weights_made.get("initialized")),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "check", choices=["env", "sync_audit", "throughput", "attention", "weights", "resume", "offload"]
    )
    parser.add_argument("--model", default="150m")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--ac", choices=["full", "selective"], default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--cp", type=int, default=4, help="attention: the context-parallel degree of the shapes")
    parser.add_argument("--init", choices=["local", "rank0"], default="local", help="weights: weights_init")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--out", default=None, help="append the result as one JSON line to this file")
    args = parser.parse_args(argv)
    checks = {"env": env, "sync_audit": sync_audit, "throughput": throughput, "attention": attention,
              "weights": weights, "resume": resume, "offload": offload}  # fmt: skip
    result = checks[args.check](args)
    result["date"] = time.strftime("%Y-%m-%d")
    result["torch"] = torch.__version__
    line = json.dumps(result)
    print(f"RESULT {line}", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
