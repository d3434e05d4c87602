"""The layout planner: every valid (pp, dp_replicate, dp_shard, cp, tp) layout for a model on a cluster, with its
per-GPU memory and step time (:mod:`cuboid.planning.estimate`), what does not fit, and a recommendation.

    python -m cuboid.layout model=8b nodes=4 gpus_per_node=8 gpu=h100
    python -m cuboid.layout model=70b nodes=1 gpus_per_node=8 gpu=h100 seq=4096
    python -m cuboid.layout model=8b nodes=1 gpus_per_node=8 gpu=h100 seq=131072   # proposes context parallel
    python -m cuboid.layout model=path/to/config.json nodes=1 gpus_per_node=8 gpu=h100   # a Hugging Face decoder

or ``cuboid.planning.planner.plan(...)``. Tensor parallel stays within a node (it must divide the GPUs per node and the
heads); pipeline stages divide the world; context parallel splits the data-parallel ranks where ``seq`` is a multiple
of ``2 x cp`` (not with pp: Cuboid does not compose them yet). For each layout it tries activation checkpointing none / selective /
full, each with and without CPU offload; at each it takes the largest per-rank batch (sequences per
data-parallel rank, up to ``max_batch``) that fits in ``headroom`` of the GPU's memory, and the step time at that
batch. It recommends the fastest that fits.

Calibrated inputs (one number each, from torchtitan's Llama 3.1 8B on 8 H100, ``ANCHORS.md``): the matmul
efficiency (its eager FSDP row, 5,762 tokens/s/GPU), the speed-ups of ``torch.compile`` (6,667 / 5,762) and
float8 (8,532 / 6,667) on the matmuls, and the causal flash attention kernels' efficiency (its cp 1 row at 32,768
tokens, 3,890 tokens/s/GPU, where attention is 62% of the compute and no ring runs). Assumed, not calibrated: link
bandwidths and latencies (vendor figures, :data:`GPUS`), HBM bandwidth, the activation count (from the reference
Llama's autograd graph), the context-parallel ring's byte counts (from torch's implementation) and the bubble
formula.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cuboid.planning.estimate import GIB, GPUS, Hardware, Memory, Setup, Shape, StepTime, fits, memory, step_time

# torchtitan's published Llama 3.1 runs on H100 (ANCHORS.md; 96 GB HBM2e machines): (model, setup, tokens/s/GPU,
# peak GiB). The first three calibrate (see _calibrate()); the rest are predictions to check the model against.
# torchtitan's Llama repeats its KV heads before attention (repeat_kv, torchtitan/models/llama/model.py at 9dec370).
_TT = {"repeat_kv": True}
TORCHTITAN: list[tuple[str, str, Setup, float, float]] = [
    ("8b", "FSDP 8, eager", Setup(dp_shard=8, batch=2, ac="selective_op", **_TT), 5762, 82.4),
    ("8b", "FSDP 8, compile", Setup(dp_shard=8, batch=2, ac="selective_op", compile=True, **_TT), 6667, 77.0),
    ("8b", "FSDP 8, compile + fp8", Setup(dp_shard=8, batch=2, ac="selective_op", compile=True, fp8=True, **_TT), 8532,
     76.8),
    ("8b", "FSDP 128, eager", Setup(dp_shard=128, batch=2, ac="selective_op", **_TT), 5605, 67.0),
    ("8b", "FSDP 128, compile", Setup(dp_shard=128, batch=2, ac="selective_op", compile=True, **_TT), 6514, 62.0),
    ("70b", "FSDP 32 x TP 8, compile + fp8", Setup(dp_shard=32, tp=8, batch=16, ac="full", compile=True, fp8=True,
                                                 **_TT), 829, 71.9),
    ("70b", "FSDP 32 x TP 8, + async TP", Setup(dp_shard=32, tp=8, batch=16, ac="full", compile=True, fp8=True,
                                              async_tp=True, **_TT), 876, 67.6),
    ("405b", "FSDP 8 x TP 8 x PP 8, 1F1B", Setup(pp=8, dp_shard=8, tp=8, batch=32, ac="full", compile=True, fp8=True,
                                                async_tp=True, microbatches=8, **_TT), 100, 82.5),
    ("405b", "FSDP 8 x TP 8 x PP 8, Interleaved 1F1B",
     Setup(pp=8, dp_shard=8, tp=8, batch=32, ac="full", compile=True, fp8=True, async_tp=True, microbatches=8,
           schedule="Interleaved1F1B", virtual_stages=2, **_TT), 128, 72.7),
]  # fmt: skip


# torchtitan's context-parallel rows (docs/performance.md, Table 2, torch 1963fc8, torchtitan 9dec370): Llama 3.1 8B
# on 8 H100, local batch 1, full activation checkpointing, compile + float8; torch's ring attention with its default
# rotate method (allgather) and head-tail load balancing, flash attention. The cp 1 row (no ring) calibrates the
# attention efficiency; the other three are predictions.
TORCHTITAN_CP: list[tuple[str, str, Setup, float, float]] = [
    ("8b", f"FSDP {8 // cp}, CP {cp}, seq {seq:,}",
     Setup(dp_shard=8 // cp, cp=cp, batch=1, seq=seq, ac="full", compile=True, fp8=True, cp_rotate="allgather", **_TT),
     tps, gib)
    for cp, seq, tps, gib in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                              (8, 262144, 548, 84.5))
]  # fmt: skip


def _calibrate(hw: Hardware | None = None) -> dict[str, float]:
    """The four calibrated inputs, each solved on one of torchtitan's rows: the matmul efficiency (8B FSDP 8,
    eager), the compile and the float8 speed-ups (8B FSDP 8 with them), and the attention kernels' efficiency (8B
    at 32,768 tokens, cp 1: attention is 62% of its compute there and no ring runs). Solved together (each row
    depends a little on the others' inputs) by fixed-point steps."""
    hw = hw or GPUS["h100-96gb"]
    shape = Shape.of("8b")
    cal = {"efficiency": 0.4, "compile_gain": 1.0, "fp8_gain": 1.0, "attention_efficiency": 0.3}
    rows = [*TORCHTITAN[:3], TORCHTITAN_CP[0]]
    for _ in range(40):  # tokens/s is close to proportional to each factor: a few fixed-point steps
        for key, (_, _, setup, tps, _) in zip(cal, rows, strict=True):
            got = step_time(shape, setup, hw, **cal)
            cal[key] *= tps / got.tokens_per_s_per_gpu
    return cal


CALIBRATION = _calibrate()


@dataclass(frozen=True)
class _Option:
    setup: Setup
    memory: Memory
    time: StepTime | None
    fits: bool
    host_fits: bool = True

    def row(self) -> dict[str, object]:
        s, m = self.setup, self.memory
        return {
            "pp": s.pp, "dp_replicate": s.dp_replicate, "dp_shard": s.dp_shard, "cp": s.cp, "tp": s.tp, "ep": s.ep,
            "ac": s.ac or "none", "cpu_offload": s.cpu_offload, "batch": s.batch if self.fits else 0,
            "persistent_gib": m.persistent / GIB, "gathered_gib": m.gathered / GIB,
            "activations_gib": m.activations / GIB, "logits_gib": m.logits / GIB, "total_gib": m.total / GIB,
            "host_gib": m.host / GIB, "stage_imbalance": m.imbalance, "fits": self.fits,
            "tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu if self.time else 0.0,
            "step_s": self.time.total if self.time else 0.0,
        }  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    shape: Shape, world: int, gpus_per_node: int, seq: int | None = None
) -> list[tuple[int, int, int, int, int]]:
    """Valid (pp, dp_replicate, dp_shard, tp, cp): tp within a node and dividing the heads, pp no more than the
    blocks, dp_replicate a divisor of the number of nodes (one replica per group of whole nodes); with ``seq``,
    cp > 1 where ``seq`` is a multiple of ``2 x cp`` and pp is 1."""
    nodes = max(world // gpus_per_node, 1)
    out = []
    for tp in _divisors(min(world, gpus_per_node)):
        if shape.heads % tp or shape.kv_heads % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > shape.layers:
                continue
            for cp in _divisors(world // (tp * pp)):
                if cp > 1 and (seq is None or pp > 1 or seq % (2 * cp)):
                    continue
                dp = world // (tp * pp * cp)
                for rep in _divisors(dp):
                    if rep > 1 and (nodes % rep or rep == dp):
                        continue
                    out.append((pp, rep, dp // rep, tp, cp))
    return out


def _expert_degrees(shape: Shape, pp: int, shard: int, tp: int, cp: int) -> list[int]:
    """Expert-parallel degrees to try: 1, and for an MoE model each divisor of ``dp_shard x cp`` (> 1) that divides
    its experts (EP borrows the ranks FSDP shards over)."""
    if not shape.experts:
        return [1]
    return [ep for ep in _divisors(shard * cp) if shape.experts % ep == 0]


def _best_batch(shape: Shape, s: Setup, hw: Hardware, headroom: float, max_batch: int) -> tuple[Setup, Memory, bool]:
    """The largest batch (sequences per data-parallel rank) that fits, searched over what the schedule allows."""
    step = s.m if s.pp > 1 else 1  # the micro-batches must split the batch
    batch, found = step, None
    while batch <= max_batch:
        trial = replace(s, batch=batch)
        mem = memory(shape, trial)
        if not fits(mem, hw, headroom):
            break
        found = (trial, mem)
        batch *= 2
    if found is None:
        trial = replace(s, batch=step)
        return trial, memory(shape, trial), False
    return found[0], found[1], True


def plan(
    model: str | Shape = "8b",
    nodes: int = 1,
    gpus_per_node: int = 8,
    gpu: str = "h100",
    seq: int = 8192,
    precision: str = "bf16-mixed",
    max_batch: int = 64,
    headroom: float = 0.9,
    compile: bool = False,
    host_memory_per_node: float = 2e12,
) -> list[_Option]:
    """Every valid layout and setting, fastest fitting first (then the ones that do not fit, smallest first)."""
    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r}: choose one of {sorted(GPUS)}.")
    hw = replace(GPUS[gpu], gpus_per_node=gpus_per_node)
    shape = model if isinstance(model, Shape) else Shape.of(model)
    world = nodes * gpus_per_node
    options = []
    for pp, rep, shard, tp, cp in layouts(shape, world, gpus_per_node, seq):
        for offload, ac, ep in [(o, a, e) for o in (False, True) for a in (None, "selective", "full")
                                for e in _expert_degrees(shape, pp, shard, tp, cp)]:  # fmt: skip
            s = Setup(pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, ep=ep, seq=seq, precision=precision,
                      ac=ac, cpu_offload=offload, compile=compile)  # fmt: skip
            s, mem, ok = _best_batch(shape, s, hw, headroom, max_batch)
            host_ok = mem.host * gpus_per_node <= host_memory_per_node
            ok = ok and host_ok
            t = step_time(shape, s, hw, **CALIBRATION) if ok else None
            if offload and t is not None:  # parameters, gradients and moments cross PCIe every step
                t = replace(t, optimizer=t.optimizer + 3 * mem.host / 25e9)
            options.append(_Option(s, mem, t, ok, host_ok))
    fitting = sorted((o for o in options if o.fits), key=lambda o: -o.time.tokens_per_s_per_gpu)
    rest = sorted((o for o in options if not o.fits), key=lambda o: o.memory.total)
    return fitting + rest


def validation_table(hw: Hardware | None = None) -> str:
    """torchtitan's published runs beside the planner's estimates (Markdown; in README and tests)."""
    hw = hw or GPUS["h100-96gb"]
    lines = ["| model | layout, variant | tokens/s/GPU published | estimated | ratio | GiB published | estimated | ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for i, (name, label, setup, tps, gib) in enumerate(TORCHTITAN + TORCHTITAN_CP):
        shape = Shape.of(name)
        got = step_time(shape, setup, hw, **CALIBRATION).tokens_per_s_per_gpu
        mem = memory(shape, setup).total / GIB
        mark = " (calibration)" if i < 3 or setup is TORCHTITAN_CP[0][2] else ""
        lines.append(f"| {name} | {label}{mark} | {tps:,.0f} | {got:,.0f} | {got / tps:.2f} | {gib} | {mem:.1f} | "
                     f"{mem / gib:.2f} |")  # fmt: skip
    return "\n".join(lines)


def table(options: list[_Option], limit: int = 20) -> str:
    head = (f"{'pp':>3} {'rep':>3} {'shard':>5} {'cp':>3} {'tp':>3} {'ep':>3} {'AC':>9} {'offload':>7} {'batch':>5} {'persist':>8} "
            f"{'gather':>7} {'activ':>7} {'logits':>7} {'total':>7} {'fits':>4} {'tok/s/GPU':>9} {'step s':>7}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for o in options[:limit]:
        r = o.row()
        lines.append(
            f"{r['pp']:>3} {r['dp_replicate']:>3} {r['dp_shard']:>5} {r['cp']:>3} {r['tp']:>3} {r['ep']:>3} {r['ac']:>9} "
            f"{'yes' if r['cpu_offload'] else 'no':>7} {r['batch']:>5} {r['persistent_gib']:>8.1f} "
            f"{r['gathered_gib']:>7.1f} {r['activations_gib']:>7.1f} {r['logits_gib']:>7.1f} {r['total_gib']:>7.1f} "
            f"{'yes' if r['fits'] else 'NO':>4} {r['tokens_per_s_per_gpu']:>9.0f} {r['step_s']:>7.2f}"
        )
    return "\n".join(lines)


def what_fits(options: list[_Option], gpus_per_node: int = 8) -> str:
    """Per setting (activation checkpointing x CPU offload): does any layout fit, and the best or the nearest."""
    lines = []
    for offload in (False, True):
        for ac in (None, "selective", "full"):
            group = [o for o in options if o.setup.ac == ac and o.setup.cpu_offload == offload]
            if not group:
                lines.append(f"  AC {ac or 'none':9} offload {'yes' if offload else 'no ':3}: not tried "
                             "(a setting without offload already fits)")  # fmt: skip
                continue
            fitting = [o for o in group if o.fits]
            if fitting:
                o = max(fitting, key=lambda o: o.time.tokens_per_s_per_gpu)
                host = f", host {o.memory.host * gpus_per_node / GIB:.0f} GiB per node" if offload else ""
                lines.append(
                    f"  AC {ac or 'none':9} offload {'yes' if offload else 'no ':3}: fits: {_name(o)}, {o.setup.batch} "
                    f"seq/rank, {o.memory.total / GIB:.1f} GiB/GPU{host}, ~{o.time.tokens_per_s_per_gpu:.0f} tok/s/GPU"
                )
            else:
                o = min(group, key=lambda o: o.memory.total)
                why = " (host memory too small)" if not o.host_fits else ""
                lines.append(
                    f"  AC {ac or 'none':9} offload {'yes' if offload else 'no ':3}: does not fit{why}: the nearest, "
                    f"{_name(o)} at {o.setup.batch} seq/rank, needs {o.memory.total / GIB:.1f} GiB/GPU"
                )
    return "\n".join(lines)


def _name(o: _Option) -> str:
    s = o.setup
    ep = f" (experts over ep{s.ep})" if s.ep > 1 else ""
    return (
        f"pp{s.pp} x rep{s.dp_replicate} x shard{s.dp_shard}"
        + (f" x cp{s.cp}" if s.cp > 1 else "")
        + f" x tp{s.tp}{ep}"
    )


def recommend(options: list[_Option]) -> str:
    fitting = [o for o in options if o.fits]
    if not fitting:
        smallest = options[0] if options else None
        need = f" (the smallest needs {smallest.memory.total / GIB:.0f} GiB per GPU)" if smallest else ""
        return f"No layout fits{need}: add GPUs, shorten the sequence, or use bf16-true / a smaller model."
    o = fitting[0]
    s = o.setup
    args = [f"pipeline_parallel={s.pp}", f"data_parallel_replicate={s.dp_replicate}",
            f"data_parallel_shard={s.dp_shard}", f"tensor_parallel={s.tp}"]  # fmt: skip
    if s.cp > 1:
        args.append(f"context_parallel={s.cp}")
    if s.ep > 1:
        args.append(f"expert_parallel={s.ep}")
    if s.ac:
        args.append(f"activation_checkpointing={s.ac!r}")
    if s.cpu_offload:
        args.append("cpu_offload=True")
    return (
        f"Recommended: CuboidStrategy({', '.join(args)}) with {s.batch} sequences of {s.seq} tokens per "
        f"data-parallel rank per step: {o.memory.total / GIB:.1f} GiB per GPU, about {o.time.tokens_per_s_per_gpu:.0f} tokens/s per GPU."
    )
