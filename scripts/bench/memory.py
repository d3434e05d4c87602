"""The memory curve: per-rank persistent and peak bytes at N = 1, 2, 4, 8 processes for one model, against 1/N.

    python scripts/bench.py --suite memory             # every layout, then the table and docs/bench/memory.png
    python scripts/bench.py --suite memory --world 2   # only the 2-process layouts
    python scripts/bench.py --suite memory --cp        # only the context-parallel rows: cp 1, 2, 4
    python scripts/bench.py --suite memory --moe       # only the mixture-of-experts rows: ep 1, 2, 4 on 4 ranks

A benchmark, not a test. One Llama (8 blocks, dim 256, vocab 2048: 7.3 M parameters) trains 3 steps of 4
sequences x 128 tokens per data-parallel rank (weak scaling: the work per rank stays the same) under FSDP at
N = 1, 2, 4, 8, HSDP (2 replicas), TP 2 x FSDP and 3D, in fp32 and bf16-mixed; and context parallel at cp = 2
and 4 (one data-parallel rank: the same 4 sequences of 128 tokens split over cp ranks), against FSDP at N = 1.
Per rank:

* persistent: parameters, gradients and AdamW state, from the DTensor local shapes after the last step;
* peak: persistent + the step's own peak, the most bytes of tensors made during a training step (forward,
  backward, optimizer step) alive at once, counted
  by a ``TorchDispatchMode`` that adds each new storage an op returns and a ``weakref.finalize`` on the storage that
  subtracts it when freed (storages made before the step, the persistent ones, are not counted here); on CPU there
  is no allocator peak to read, and this counts tensors, not the allocator's cache;
* two parts of that step, each measured on its own (see :class:`Measure`): the gathered parameters of the largest
  block and of the root unit, and the activations saved for backward (and how much of them stays float32), so
  that fp32 and bf16-mixed can be set side by side part by part.

Writes ``docs/bench/memory.json`` and ``docs/bench/memory.png`` (log-log, with the 1/N line; needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import weakref
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from launch import launch_per_world, per_world_parser, write_results
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.experts import experts_modules
from cuboid.measure import held_bytes, local_nbytes
from cuboid.models import CausalLM, LlamaConfig

CFG = LlamaConfig(vocab_size=2048, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=256)
BATCH, SEQ, STEPS = 4, 128, 3
LAYOUTS: dict[int, list[tuple[str, str, dict]]] = {
    1: [("FSDP", p, {}) for p in ("32-true", "bf16-mixed")],
    2: [("FSDP", p, {}) for p in ("32-true", "bf16-mixed")] + [("TP2 x FSDP", "32-true", {"tensor_parallel": 2})],
    4: [("FSDP", p, {}) for p in ("32-true", "bf16-mixed")]
    + [("HSDP 2 x", "32-true", {"data_parallel_replicate": 2}), ("TP2 x FSDP", "32-true", {"tensor_parallel": 2})],
    8: [("FSDP", p, {}) for p in ("32-true", "bf16-mixed")]
    + [("HSDP 2 x", "32-true", {"data_parallel_replicate": 2}), ("TP2 x FSDP", "32-true", {"tensor_parallel": 2}),
       ("3D pp2 x dp2 x tp2", "32-true", {"pipeline_parallel": 2, "tensor_parallel": 2})],
}  # fmt: skip
# Context parallel at a fixed sequence length: cp ranks share one data-parallel rank's sequences.
CP_LAYOUTS: dict[int, list[tuple[str, str, dict]]] = {
    1: [("FSDP", "32-true", {})],
    2: [("CP", "32-true", {"context_parallel": 2})],
    4: [("CP", "32-true", {"context_parallel": 4})],
}
# Mixture of experts (--moe): the same Llama with 8 experts of width 256 per block (top-2), FSDP over 4 ranks,
# the experts split over ep = 1, 2, 4 of them.
MOE_CFG = replace(CFG, n_experts=8, top_k=2, moe_ffn_dim=256)
MOE_LAYOUTS: dict[int, list[tuple[str, str, dict]]] = {
    4: [(f"MoE ep{ep}", "32-true", {"expert_parallel": ep}) for ep in (1, 2, 4)],
}
LAYOUTS[2].append(CP_LAYOUTS[2][0])
LAYOUTS[4].append(CP_LAYOUTS[4][0])


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops return, alive now and at most (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self.live:
                continue
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out


class Measure(L.Callback):
    """The step's peak (:class:`LiveBytes`), and two of its parts measured on their own:

    * gathered: the bytes of one FSDP unit's parameters as its forward sees them (all-gathered, in FSDP's compute
      dtype), read by a forward pre-hook that runs after FSDP's own; the largest block and the root unit;
    * saved: the activations autograd keeps for backward in one step (``saved_tensors_hooks``; each storage once,
      gathered parameters left out: they are the first part).
    """

    def __init__(self) -> None:
        self.mode: LiveBytes | None = None
        self.peaks: list[int] = []
        self.gathered: dict[str, int] = {}
        self.saved: list[int] = []
        self.saved_fp32: list[int] = []  # the part of it kept in float32
        self._gathered: dict[int, torch.Tensor] = {}  # the unsharded parameters FSDP's forward hands the blocks
        self._saved_keys: set[int] = set()
        self._hooks: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        for _, module in experts_modules(pl_module):  # MoE: what one layer's experts hold while they compute
            module.register_forward_pre_hook(self._experts_hook)
        units = [(n, m) for n, m in pl_module.named_modules() if isinstance(m, FSDPModule)]
        nested = {n for n, _ in units}
        for name, unit in units:
            own = [pn for pn, _ in unit.named_parameters()
                   if not any(f"{name}.{pn}".startswith(f"{o}.") for o in nested if o != name and o.startswith(name))]  # fmt: skip
            kind = (
                "block" if name.rsplit(".", 1)[-1].isdigit() else "experts" if hasattr(unit, "num_experts") else "root"
            )
            unit.register_forward_pre_hook(self._gathered_hook(kind, own))

    def _gathered_hook(self, kind: str, names: list[str]):
        def hook(module: torch.nn.Module, args: Any) -> None:
            params = [module.get_parameter(n) for n in names]
            self._gathered.update((id(p), p) for p in params)
            self.gathered[kind] = max(self.gathered.get(kind, 0), sum(local_nbytes(p) for p in params))

        return hook

    def _experts_hook(self, module: torch.nn.Module, args: Any) -> None:
        held = sum(local_nbytes(p) for p in module.parameters(recurse=False))
        self.gathered["experts_layer"] = max(self.gathered.get("experts_layer", 0), held)

    def _live_param_storages(self) -> set[int]:
        """Storages of the gathered parameters now (FSDP frees them after use: an address alone may be reused)."""
        keys = set()
        for p in self._gathered.values():
            local = p.to_local() if isinstance(p, DTensor) else p
            storage = local.untyped_storage()
            if storage.nbytes():
                keys.add(storage.data_ptr())
        return keys

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        inner = t.to_local() if isinstance(t, DTensor) else t
        if inner.device.type == "meta":
            return t
        try:
            key, nbytes = inner.untyped_storage().data_ptr(), inner.untyped_storage().nbytes()
        except RuntimeError:  # a wrapper without a storage of its own (a collective's pending result): its size
            key, nbytes = id(inner), inner.numel() * inner.element_size()
        if key in self._saved_keys or key in self._live_param_storages():
            return t
        self._saved_keys.add(key)
        self.saved[-1] += nbytes
        if inner.dtype == torch.float32:
            self.saved_fp32[-1] += nbytes
        return t

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._saved_keys = set()
        self.saved.append(0)
        self.saved_fp32.append(0)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self.mode = LiveBytes()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        assert self.mode is not None
        self.mode.__exit__(None, None, None)
        self._hooks.__exit__(None, None, None)
        self.peaks.append(self.mode.peak)


def persistent_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    held = held_bytes(module, optimizer)
    return held["params"] + max(held["grads"], held["params"]) + held["optim"]  # freed gradients counted as held


def run_layout(label: str, precision: str, kwargs: dict, world: int, cfg: LlamaConfig = CFG) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    measure = Measure()
    strategy = CuboidStrategy(timeout=timedelta(seconds=120), **kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=precision, max_steps=STEPS,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[measure])  # fmt: skip
    layout = strategy.layout.resolve(world)
    tokens = torch.randint(
        0, CFG.vocab_size, (BATCH * STEPS * layout.dp, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    module = CausalLM(model=cfg, warmup_steps=1, max_steps=STEPS)
    trainer.fit(module, DataLoader(tokens, batch_size=BATCH))
    shards = sum(local_nbytes(p) for n, p in module.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    return {"layout": label, "precision": precision, "world": world, "cp": layout.cp, "peak": max(measure.peaks[1:]),
            "persistent": persistent_bytes(module, trainer.optimizers[0]), "saved": max(measure.saved[1:]),
            "saved_fp32": max(measure.saved_fp32[1:]),
            "gathered_block": measure.gathered.get("block", 0), "gathered_root": measure.gathered.get("root", 0),
            "experts_shards": shards, "experts_layer": measure.gathered.get("experts_layer", 0)}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    results = []
    for label, precision, kwargs in (MOE_LAYOUTS if args.moe else CP_LAYOUTS if args.cp else LAYOUTS)[world]:
        one = run_layout(label, precision, kwargs, world, MOE_CFG if args.moe else CFG)
        per_rank: list = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(per_rank, one)
        else:
            per_rank = [one]
        results.append({**one, **{k: max(r[k] for r in per_rank) for k in ("peak", "persistent", "saved", "saved_fp32",
                                                                           "gathered_block", "gathered_root",
                                                                           "experts_shards", "experts_layer")},
                        "total": max(r["peak"] + r["persistent"] for r in per_rank)})  # fmt: skip
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.part).write_text(json.dumps(results))


def parts_table(results: list[dict[str, Any]]) -> str:
    """fp32 against bf16-mixed, part by part, for each layout and N measured in both."""
    mib = 2**20
    lines = [f"{'layout':<20}{'N':>3}  {'part (MiB per rank)':<34}{'32-true':>9}{'bf16-mixed':>12}{'ratio':>7}"]
    parts = [("persistent (params, grads, AdamW)", lambda r: r["persistent"]),
             ("gathered parameters, largest block", lambda r: r["gathered_block"]),
             ("gathered parameters, root unit", lambda r: r["gathered_root"]),
             ("saved activations", lambda r: r["saved"]),
             ("  of which kept in float32", lambda r: r["saved_fp32"]),
             ("step peak (live tensors)", lambda r: r["peak"])]  # fmt: skip
    both = {(r["layout"], r["world"], r["precision"]): r for r in results}
    for (label, world, precision), fp32 in sorted(both.items()):
        bf16 = both.get((label, world, "bf16-mixed"))
        if precision != "32-true" or bf16 is None:
            continue
        for name, get in parts:
            a, b = get(fp32), get(bf16)
            lines.append(f"{label:<20}{world:>3}  {name:<34}{a / mib:>9.2f}{b / mib:>12.2f}"
                         f"{(b / a if a else float('nan')):>7.2f}")  # fmt: skip
    return "\n".join(lines)


def cp_table(results: list[dict[str, Any]]) -> str:
    """Context parallel at one sequence length: per-rank saved activations and step peak at cp 1, 2, 4, beside
    1/cp of cp 1's. cp 1 is FSDP on one process: the same sequences per data-parallel rank."""
    rows = [r for r in results if r["precision"] == "32-true" and (r["layout"] == "CP" or r["world"] == 1)]
    base = next((r for r in rows if r["world"] == 1), None)
    if base is None:
        return "(no cp 1 row: run with --world 1 too)"
    mib = 2**20
    lines = [f"{'cp':>3}{'saved activations MiB':>23}{'1/cp of cp 1':>14}{'ratio':>7}{'step peak MiB':>15}"
             f"{'1/cp of cp 1':>14}{'ratio':>7}"]  # fmt: skip
    for r in sorted(rows, key=lambda r: r.get("cp", 1)):
        cp = r.get("cp", 1)
        lines.append(f"{cp:>3}{r['saved'] / mib:>23.2f}{base['saved'] / cp / mib:>14.2f}"
                     f"{r['saved'] * cp / base['saved']:>7.2f}{r['peak'] / mib:>15.2f}{base['peak'] / cp / mib:>14.2f}"
                     f"{r['peak'] * cp / base['peak']:>7.2f}")  # fmt: skip
    return "\n".join(lines)


def moe_table(results: list[dict[str, Any]]) -> str:
    """Per rank, at ep 1, 2, 4 on 4 ranks: the experts' shards (in the persistent bytes: FSDP already splits them
    over the 4 ranks, ep only changes which), one layer's experts while they compute (all 8 gathered at ep 1,
    8 / ep at ep), against 1/ep of ep 1's, and the persistent and peak totals."""
    base = next((r for r in results if r["layout"] == "MoE ep1"), None)
    if base is None:
        return "(no ep 1 row)"
    mib = 2**20
    lines = [f"{'layout':<10}{'expert shards MiB':>18}{'one layer computing MiB':>25}{'1/ep of ep1':>13}{'ratio':>7}"
             f"{'persistent MiB':>16}{'step peak MiB':>15}"]  # fmt: skip
    for r in sorted(results, key=lambda r: r["layout"]):
        ep = int(r["layout"].rsplit("ep", 1)[1])
        lines.append(f"{r['layout']:<10}{r['experts_shards'] / mib:>18.2f}{r['experts_layer'] / mib:>25.2f}"
                     f"{base['experts_layer'] / ep / mib:>13.2f}{r['experts_layer'] * ep / base['experts_layer']:>7.2f}"
                     f"{r['persistent'] / mib:>16.2f}{r['peak'] / mib:>15.2f}")  # fmt: skip
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    base = {r["precision"]: r for r in results if r["world"] == 1}
    lines = [f"{'layout':<20}{'precision':<12}{'N':>3}{'persistent MiB':>16}{'x N / N=1':>11}{'step peak MiB':>15}"
             f"{'peak MiB':>10}{'x N / N=1':>11}"]  # fmt: skip
    for r in sorted(results, key=lambda r: (r["layout"], r["precision"], r["world"])):
        one = base.get(r["precision"])
        scaled = {k: f"{r[k] * r['world'] / one[k]:.2f}" if one else "-" for k in ("persistent", "total")}
        lines.append(f"{r['layout']:<20}{r['precision']:<12}{r['world']:>3}{r['persistent'] / 2**20:>16.2f}"
                     f"{scaled['persistent']:>11}{r['peak'] / 2**20:>15.2f}{r['total'] / 2**20:>10.2f}"
                     f"{scaled['total']:>11}")  # fmt: skip
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    base = next(r for r in results if r["world"] == 1 and r["precision"] == "32-true")
    ns = [1, 2, 4, 8]
    ax.plot(ns, [base["persistent"] / 2**20 / n for n in ns], "k:", label="1/N from N=1 (persistent)")
    for (label, precision), marker in zip(
        sorted({(r["layout"], r["precision"]) for r in results}), "osD^v<>", strict=False
    ):
        rows = sorted(
            (r for r in results if (r["layout"], r["precision"]) == (label, precision)), key=lambda r: r["world"]
        )
        xs = [r["world"] for r in rows]
        ax.plot(xs, [r["persistent"] / 2**20 for r in rows], marker=marker, label=f"{label} {precision}: persistent")
        ax.plot(
            xs,
            [r["total"] / 2**20 for r in rows],
            marker=marker,
            linestyle="--",
            label=f"{label} {precision}: peak",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("processes N")
    ax.set_ylabel("MiB per rank")
    ax.set_title("Per-rank bytes vs N: 7.3 M-parameter Llama, 4 x 128 tokens per dp rank", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = per_world_parser(__doc__, "1, 2, 4 or 8", "docs/bench/memory.json")
    parser.add_argument("--cp", action="store_true", help="only the context-parallel rows (cp 1, 2, 4)")
    parser.add_argument("--moe", action="store_true", help="only the mixture-of-experts rows (ep 1, 2, 4 on 4 ranks)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.moe:
        results = launch_per_world(__file__, "memory", [4], ["--moe"])
        print(moe_table(results))
        write_results(args.out.replace("memory.json", "memory_moe.json"), {"batch": BATCH, "seq": SEQ}, results)
        return
    if args.cp:
        results = launch_per_world(__file__, "memory", args.world or sorted(CP_LAYOUTS), ["--cp"])
        print(cp_table(results))
        write_results(args.out.replace("memory.json", "memory_cp.json"), {"batch": BATCH, "seq": SEQ}, results)
        return
    results = launch_per_world(__file__, "memory", args.world or sorted(LAYOUTS), [])
    print(table(results))
    print(parts_table(results))
    print(cp_table(results))
    write_results(args.out, {"batch": BATCH, "seq": SEQ, "steps": STEPS}, results)
    if not args.world:
        plot(results, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
