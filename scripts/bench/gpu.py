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
    """Wall time of the steps after ``warmup`` (synchronized once at each end: a benchmark may wait)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.t0, self.t1, self.steps = warmup, 0.0, 0.0, 0

    def _sync(self, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.warmup:
            self._sync(module)
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self._sync(module)
            self.t1, self.steps = time.perf_counter(), trainer.global_step - self.warmup


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
    step_s = (clock.t1 - clock.t0) / max(1, clock.steps)
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
    """cpu_offload=True with meta init and gradient clipping: shards live on the host, steps run on the GPU."""
    module = CausalLM(model=args.model, meta_init=True, warmup_steps=2, max_steps=args.steps)
    losses = Losses()
    strategy = CuboidStrategy(cpu_offload=args.accelerator != "cpu")
    trainer = trainer_for(
        args, strategy, max_steps=args.steps, callbacks=[losses], log_every_n_steps=1, gradient_clip_val=1.0
    )
    data = tokens(args.batch * args.steps, args.seq, module.cfg.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    devices = sorted({str(p.device) for p in module.parameters()})
    values = [losses.by_step[s] for s in sorted(losses.by_step)]
    return {
        "check": "offload",
        "model": args.model,
        "parameter_devices": devices,
        "losses": [round(v, 4) for v in values],
        "peak_mem_gib": round(peak_memory_bytes(module.device) / 2**30, 2),
        # (random tokens: the loss need not fall in a few steps) the shards stay on the host under offload
        "ok": len(values) == args.steps
        and all(math.isfinite(v) for v in values)
        and (args.accelerator == "cpu" or devices == ["cpu"]),
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


def attention(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel ``scaled_dot_product_attention`` picks for context parallel's shapes, and its forward + backward
    time: one query chunk (``seq / cp`` tokens) against the gathered keys (``seq``), causal through a boolean mask
    as Cuboid's exchange passes it today, with every head repeated and with grouped-query heads
    (``enable_gqa``); then the chunk's causal diagonal block without a mask (``is_causal``: what a flash kernel
    can run)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    device = torch.device("cuda" if args.accelerator != "cpu" else "cpu")
    dtype = torch.bfloat16 if args.accelerator != "cpu" else torch.float32
    heads, kv_heads, dim = (32, 8, 128) if args.accelerator != "cpu" else (4, 2, 16)
    chunk = args.seq // args.cp
    picked: list[str] = []

    class Kernel(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name.startswith("_scaled_dot_product") and "backward" not in name:
                picked.append(name)
            return func(*a, **(kwargs or {}))

    rows = []
    for masked, gqa in ((True, False), (True, True), (False, False), (False, True)):
        g = torch.Generator(device=device).manual_seed(0)
        keys = args.seq if masked else chunk  # unmasked: the chunk's causal diagonal block
        q = torch.randn(1, heads, chunk, dim, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(1, kv_heads if gqa else heads, keys, dim, device=device, dtype=dtype, generator=g)
                for _ in range(2))  # fmt: skip
        mask = None
        if masked:  # the last chunk's rows: it sees every earlier key
            mask = torch.ones(chunk, args.seq, dtype=torch.bool, device=device).tril(args.seq - chunk)
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()

        call = {"attn_mask": mask, "is_causal": not masked, "enable_gqa": gqa}

        def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: dict[str, Any]) -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, **call).sum().backward()

        picked.clear()
        with Kernel():
            step(q, k, v, call)
        kernel = picked[0] if picked else "math (no fused kernel)"
        for _ in range(2):
            step(q, k, v, call)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, n = time.perf_counter(), 5
        for _ in range(n):
            step(q, k, v, call)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append({"mask": masked, "gqa": gqa, "q_tokens": chunk, "keys": keys, "kernel": kernel,
                     "ms": round((time.perf_counter() - start) / n * 1000, 3)})  # fmt: skip
    blocks = block_attention_row(device, dtype, heads, kv_heads, dim, chunk)
    rows.append(blocks)
    return {"check": "attention", "seq": args.seq, "cp": args.cp, "dtype": str(dtype), "rows": rows,
            "ok": blocks["ok"]}  # fmt: skip


def block_attention_row(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, tokens: int
) -> dict[str, Any]:
    """Cuboid's block attention (``cuboid.context.blocks``) on a one-rank cp group, so its two query chunks are
    two blocks merged by their log-sum-exp, against causal ``scaled_dot_product_attention`` over the same tokens:
    the kernel it runs, the largest relative difference of the output and gradients (bf16: within 2e-2), and both
    timings."""
    import os

    import torch.distributed as dist

    from cuboid import compat
    from cuboid.context.attention import cp_attention

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29591")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(1, kv_heads, tokens, dim, device=device, dtype=dtype, generator=g).requires_grad_()
            for _ in range(2))  # fmt: skip
    grad = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype, generator=g)

    def full() -> list[torch.Tensor]:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return [out, *torch.autograd.grad(out, (q, k, v), grad)]

    def mine() -> list[torch.Tensor]:
        out = cp_attention(q, k, v, dist.group.WORLD, tokens, is_causal=True, enable_gqa=True)
        return [out, *torch.autograd.grad(out, (q, k, v), grad)]

    want, got = full(), mine()
    worst = max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want, strict=True)
    )
    times = {}
    for name, fn in (("sdpa_ms", full), ("blocks_ms", mine)):
        for _ in range(2):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times[name] = round((time.perf_counter() - start) / 5 * 1000, 3)
    kernel = compat.lse_kernel(q, masked=False) or "masked fallback"
    return {"blocks": True, "kernel": kernel, "q_tokens": tokens, "max_rel_diff": worst, **times,
            "ok": worst <= (2e-2 if dtype != torch.float32 else 1e-5)}  # fmt: skip


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
