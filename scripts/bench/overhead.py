"""Per training step: host syncs, object collectives and collectives by kind, for each layout.

    python scripts/bench.py --suite overhead            # every layout (2, 4 and 8 processes), then the table
    python scripts/bench.py --suite overhead --world 2  # only the 2-process layouts

A benchmark, not a test. The module is the main job's ``cuboid.models.CausalLM`` (its own logging) on a small
Llama; the Trainer logs every ``--log-every`` steps (no progress bar). A ``TorchDispatchMode`` active from one
step's start to the next counts what reaches the dispatcher: host syncs (``aten._local_scalar_dense``: ``.item()``,
``float(t)``, ``bool(t)``; on a GPU these stall the launch queue), and each ``c10d`` collective with its bytes (the
largest tensor argument: the gathered buffer of an all-gather, the input of a reduce-scatter). Object collectives
(``broadcast_object_list``, ``all_gather_object``, ...) are counted where they are called. A ``TorchFunctionMode``
beside it counts tensors made on the host (a factory such as ``torch.tensor``, ``torch.arange`` or ``torch.zeros``
called without ``device``: on a GPU it makes a CPU tensor, which an op with device tensors must copy over) and each
copy of such a tensor toward a device (``.to(device)``, ``.cuda()``, ``copy_``); both are seen on CPU too, and so
is a ``.tolist()`` of a tensor not on the host (a device-to-host sync on a GPU, counted with the host syncs). A
deliberate host tensor names its device (``device="cpu"``: Cuboid's gloo stop flag) and is not counted. Steps split
into those that log and those that do not; warm-up steps are dropped. ``saved KiB``: what autograd keeps for
backward in one step (distinct storages through ``saved_tensors_hooks``: activations, and the weights matmuls
keep), which sequence parallel shrinks (``tp2`` against ``tp2-no_sp``). Lightning's ModelParallelStrategy runs the
same module on the dp x tp layouts (parallelized by hand, as bench.py does). Writes ``docs/bench/overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from collections import defaultdict
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from launch import launch_per_world, per_world_parser, write_results
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.models import TP_PLAN_NO_SP, CausalLM, LlamaConfig

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
MOE = replace(CFG, n_experts=4, top_k=2)  # for expert parallel: the same Llama with experts
NO_SP = {f"model.{k}": v for k, v in TP_PLAN_NO_SP.items()}  # the reference plan without sequence/loss parallel
LAYOUTS: dict[int, list[tuple[str, str, dict]]] = {
    2: [("dp2", "cuboid", {}), ("tp2", "cuboid", {"tensor_parallel": 2}),
        ("tp2-no_sp", "cuboid", {"tensor_parallel": 2, "tensor_parallel_plan": NO_SP}),
        ("tp2-ac_selective", "cuboid", {"tensor_parallel": 2, "activation_checkpointing": "selective"}),
        ("pp2", "cuboid", {"pipeline_parallel": 2}),
        ("cp2", "cuboid", {"context_parallel": 2}),
        ("ep2", "cuboid", {"expert_parallel": 2}),
        ("ep2-ac_selective", "cuboid", {"expert_parallel": 2, "activation_checkpointing": "selective"}),
        ("ep2-ac_full", "cuboid", {"expert_parallel": 2, "activation_checkpointing": "full"}),
        ("dp2", "lightning_mp", {}), ("tp2", "lightning_mp", {"tensor_parallel_size": 2})],
    4: [("dp2xtp2", "cuboid", {"tensor_parallel": 2}), ("pp2xdp2", "cuboid", {"pipeline_parallel": 2}),
        ("pp2xdp2-reshard", "cuboid", {"pipeline_parallel": 2, "reshard_after_forward": True}),
        ("dp2xtp2", "lightning_mp", {"tensor_parallel_size": 2})],
    8: [("pp2xdp2xtp2", "cuboid", {"pipeline_parallel": 2, "tensor_parallel": 2})],
}  # fmt: skip
SITES = "--sites" in sys.argv
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
# Factories that make a tensor from sizes or Python data, on the default (host) device unless given ``device``.
FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.range, torch.linspace, torch.zeros, torch.ones,
             torch.full, torch.empty, torch.eye, torch.rand, torch.randn, torch.randint,
             torch.scalar_tensor}  # fmt: skip
TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}
HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy}  # read on the host (``.item()`` is counted at dispatch)


class HostTensors(TorchFunctionMode):
    """Counts into ``counter`` the tensors a step makes on the host, their copies toward a device, and host reads of
    device tensors that do not reach the dispatcher on CPU (``.tolist()``: a device-to-host sync on a GPU). It follows
    which tensors live on the host: a factory's without ``device`` (counted) or with ``device="cpu"`` spelt out (on
    purpose; a ``torch.device`` taken from a tensor is the device side, even when a CPU run makes it ``cpu``),
    and whatever an op computes from host tensors alone."""

    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter
        self.host: dict[int, weakref.ref] = {}  # id -> a tensor on the host (ids are reused once it is freed)

    def _on_host(self, value: Any) -> bool:
        ref = self.host.get(id(value)) if isinstance(value, torch.Tensor) else None
        return ref is not None and ref() is value

    def _mark(self, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.host[id(t)] = weakref.ref(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        if func in FACTORIES and (device is None or device == "cpu"):  # "cpu" spelt out: meant for the host
            if device is None:
                self.counter.host_tensors += 1
                self.counter._site("host tensor")
            self._mark(out)
        elif func in TO_DEVICE:
            targets = [*args[1:], device]
            moves = func is torch.Tensor.cuda or any(isinstance(t, (torch.device, str, torch.Tensor)) for t in targets)
            if moves and self._on_host(args[0]):
                self.counter.host_copies += 1
                self.counter._site("host-to-device copy")
        elif func is torch.Tensor.copy_:
            if len(args) > 1 and self._on_host(args[1]) and not self._on_host(args[0]):
                self.counter.host_copies += 1
                self.counter._site("host-to-device copy")
        elif func in HOST_READS:  # torch's own reads (inside an object collective) are counted as that collective
            if not self._on_host(args[0]) and "/torch/" not in sys._getframe(1).f_code.co_filename:
                self.counter.host_syncs += 1
                self.counter._site("sync")
        else:
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if inputs and all(self._on_host(t) for t in inputs):
                self._mark(out)  # computed from host tensors alone: still on the host
        return out


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self, exclude: set[int] | None = None) -> None:
        self.exclude = exclude or set()  # tensors kept on the host on purpose (AdamW's step counts): no device sync
        self.sites: dict[str, int] = defaultdict(int)
        self.host_syncs = 0
        self.host_tensors = 0  # made on the host inside the step (HostTensors)
        self.host_copies = 0  # of those, copies toward a device
        self.objects = 0
        self.saved: dict[int, int] = {}  # storages autograd saved for backward: data pointer -> bytes
        self.collectives: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            if id(args[0]) not in self.exclude:
                self.host_syncs += 1
                self._site("sync")
        elif func.namespace in ("c10d", "_c10d_functional"):
            self._site(name)
            entry = self.collectives[name.strip("_")]
            entry[0] += 1
            entry[1] += max((_nbytes(a) for a in args), default=0)
        return func(*args, **(kwargs or {}))

    def _site(self, what: str) -> None:
        """Where it came from: the innermost frame outside torch (with ``--sites``)."""
        if not SITES:
            return
        import traceback

        frames = [f for f in traceback.extract_stack()[:-3] if "/torch/" not in f.filename and f.filename != __file__]
        if frames:
            f = frames[-1]
            self.sites[f"{what} @ {Path(f.filename).name}:{f.lineno} {f.name}"] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "host_syncs": self.host_syncs,
            "host_tensors": self.host_tensors,
            "host_copies": self.host_copies,
            "object_collectives": self.objects,
            "collectives": {k: {"count": v[0], "bytes": v[1]} for k, v in sorted(self.collectives.items())},
            "saved_bytes": sum(self.saved.values()),
            "sites": dict(self.sites),
        }


def _nbytes(arg: Any) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_nbytes(a) for a in arg)
    return 0


class StepWindows(L.Callback):
    """Counts from each training step's start to the next one's (the step, its logging, its callbacks)."""

    def __init__(self) -> None:
        self.counter = Counter()
        self.host = HostTensors(self.counter)
        self.steps: list[dict[str, Any]] = []
        self._logs = False
        self._active = False
        for name in OBJECT_COLLECTIVES:  # count object collectives where anything calls them
            original = getattr(dist, name)

            def counted(*args: Any, __original=original, **kwargs: Any) -> Any:
                if self._active:
                    self.counter.objects += 1
                return __original(*args, **kwargs)

            setattr(dist, name, counted)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Saved for backward (activations, and the weights a matmul keeps): bytes per distinct storage."""
        self._count_storage(tensor)
        return tensor

    def _count_storage(self, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(tensor):  # DTensor, a functional collective's result: count what they wrap
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                self._count_storage(getattr(tensor, name))
        elif tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            self.counter.saved[storage.data_ptr()] = storage.nbytes()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._close()
        self._logs = trainer._logger_connector.should_update_logs  # noqa: SLF001 (a benchmark may look inside)
        steps = {id(s["step"]) for opt in trainer.optimizers for s in opt.state.values() if "step" in s}
        self.counter.reset(steps)
        if not self._active:
            self.counter.__enter__()
            self.host.__enter__()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()
            self._active = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()
        if self._active:
            self._hooks.__exit__(None, None, None)
            self.host.__exit__(None, None, None)
            self.counter.__exit__(None, None, None)
            self._active = False

    def _close(self) -> None:
        if self._active:
            self.steps.append({"logs": self._logs, **self.counter.snapshot()})


class ByHand(CausalLM):
    """The same module for Lightning's ModelParallelStrategy: configure_model parallelizes by hand."""

    def configure_model(self) -> None:
        super().configure_model()
        sys.path.insert(0, str(Path(__file__).parent))
        from fsdp_tp import LM

        self.by_hand = True
        LM.configure_model(self)


def run_layout(name: str, kind: str, kwargs: dict, world: int, steps: int, log_every: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    if kind == "cuboid":
        strategy: Any = CuboidStrategy(timeout=timedelta(seconds=120), **kwargs)
        model = MOE if kwargs.get("expert_parallel", 1) > 1 else CFG
        module: CausalLM = CausalLM(model=model, warmup_steps=2, max_steps=steps)
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        tp = kwargs.get("tensor_parallel_size", 1)
        strategy = ModelParallelStrategy(
            data_parallel_size=world // tp, tensor_parallel_size=tp, timeout=timedelta(seconds=120)
        )
        module = ByHand(model=CFG, warmup_steps=2, max_steps=steps)
    windows = StepWindows()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        log_every_n_steps=log_every,
        gradient_clip_val=1.0 if kind == "cuboid" else None,
        logger=L.pytorch.loggers.CSVLogger(f"/tmp/cuboid-overhead-{name}-{kind}"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[windows],
    )
    dp = world // (kwargs.get("tensor_parallel", 1) * kwargs.get("tensor_parallel_size", 1)
                   * kwargs.get("pipeline_parallel", 1))  # fmt: skip
    tokens = torch.randint(0, CFG.vocab_size, (8 * steps * dp, 33), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(tokens, batch_size=8))
    if kwargs.get("activation_checkpointing"):  # the checkpoint's own hooks hold what it keeps: not counted here
        for step in windows.steps:
            step["saved_bytes"] = None
    return {"layout": name, "strategy": kind, "world": world, "steps": windows.steps}


def summarize(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, logs in (("quiet", False), ("logging", True)):
        chosen = [s for s in steps[warmup:] if s["logs"] == logs]
        if not chosen:
            continue
        kinds = sorted({k for s in chosen for k in s["collectives"]})
        out[label] = {
            "steps": len(chosen),
            "saved_bytes": None if chosen[0]["saved_bytes"] is None else max(s["saved_bytes"] for s in chosen),
            "host_syncs": sum(s["host_syncs"] for s in chosen) / len(chosen),
            "host_tensors": sum(s["host_tensors"] for s in chosen) / len(chosen),
            "host_copies": sum(s["host_copies"] for s in chosen) / len(chosen),
            "object_collectives": sum(s["object_collectives"] for s in chosen) / len(chosen),
            "collectives": {
                k: {
                    "count": sum(s["collectives"].get(k, {}).get("count", 0) for s in chosen) / len(chosen),
                    "bytes": sum(s["collectives"].get(k, {}).get("bytes", 0) for s in chosen) / len(chosen),
                }
                for k in kinds
            },
        }
    return out


def worker(args: argparse.Namespace) -> None:
    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ["WORLD_SIZE"])
    results = []
    for name, kind, kwargs in LAYOUTS[world]:
        result = run_layout(name, kind, kwargs, world, args.steps, args.log_every)
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, result["steps"])
        results.append({**result, "rank0": summarize(per_rank[0], args.warmup),
                        "max_over_ranks": _max_over_ranks([summarize(s, args.warmup) for s in per_rank])})  # fmt: skip
    if dist.get_rank() == 0:
        Path(args.part).write_text(json.dumps(results))


def _max_over_ranks(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step class, the largest host-sync and object-collective counts of any rank."""
    out = {}
    for label in ("quiet", "logging"):
        present = [s[label] for s in summaries if label in s]
        if present:
            keys = ("host_syncs", "host_tensors", "host_copies", "object_collectives")
            out[label] = {k: max(p[k] for p in present) for k in keys}
    return out


def _kib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1024:.0f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'layout':<18}{'strategy':<14}{'step':<9}{'host syncs':>11}{'host made':>10}{'H2D':>5}"
             f"{'object coll.':>13}{'saved KiB':>10}  collectives per step (count, KiB)"]  # fmt: skip
    for r in results:
        for label, s in r["rank0"].items():
            worst = r["max_over_ranks"][label]
            kinds = ", ".join(f"{k} {v['count']:g} ({v['bytes'] / 1024:.0f})" for k, v in s["collectives"].items())
            lines.append(
                f"{r['layout']:<18}{r['strategy']:<14}{label:<9}{worst['host_syncs']:>11g}"
                f"{worst['host_tensors']:>10.3g}{worst['host_copies']:>5.3g}{worst['object_collectives']:>13.3g}"
                f"{_kib(s['saved_bytes']):>10}  {kinds}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = per_world_parser(__doc__, "2, 4 or 8", "docs/bench/overhead.json")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--sites", action="store_true", help="also record where each sync and collective came from")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    forwarded = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--log-every", str(args.log_every)]
    forwarded += ["--sites"] if args.sites else []
    results = launch_per_world(__file__, "overhead", args.world or sorted(LAYOUTS), forwarded)
    print(table(results))
    meta = {"steps": args.steps, "warmup": args.warmup, "log_every_n_steps": args.log_every}
    write_results(args.out, meta, results)


if __name__ == "__main__":
    main()
