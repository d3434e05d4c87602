"""``layout="auto"``: the layout, activation checkpointing and micro-batches chosen from a measured module.

:func:`choose` takes a :class:`~cuboid.planning.measured.Profile` (one training step measured on fake tensors) and
the module built on meta, and costs every layout Cuboid can apply to that module on the devices at hand:

* candidates: ``pp x dp_replicate x dp_shard x tp`` over the world, keeping every size the user gave; tensor
  parallel where the module has a plan (its own, Cuboid's, transformers') and within a node; pipeline parallel
  where the module cuts into stages; each with activation checkpointing off and, where the module has blocks, on
  (``"full"``); data parallel as DDP does it (replicated) or sharded (FSDP2).
* memory per rank, on its fullest pipeline stage: the parameter shards this layout leaves it (counted from the
  meta module as setup's fit check counts them, :func:`cuboid.measure.estimate`), as many gradients, the
  optimizer's state (its elements per trained element measured), what FSDP2 gathers (the root's own parameters for
  the step, as its all-gather output and the parameters copied out of it; two blocks in flight and one block's
  gradients) or DDP's gradient buckets (a second copy of the
  gradients), and the step's working bytes: the measured activations and backward temporaries per sample, times the
  samples a rank runs at once, divided by ``tp`` for the blocks' part (Cuboid's plans keep the sequence sharded
  between blocks) and cut to the blocks' inputs under full checkpointing, whose backward then peaks at the larger of
  its temporaries and one recomputed block's set; under pp, the stage's blocks times the micro-batches 1F1B keeps
  in flight.
* step time: the measured FLOPs per sample over the device's peak at the planner's calibrated efficiency, full
  checkpointing's extra forward, the collectives each layout adds (an alpha-beta ring model on the device's
  links: DDP's all-reduce, FSDP's gathers and reduce-scatter beyond what compute hides, tensor parallel's four
  collectives per block and direction, the pipeline's bubble ``(p - 1) / (m + p - 1)``).

It recommends the layout that trains the most samples per second (each data-parallel rank its own batch; within
5% of the fastest, the simplest: fewer dimensions, replicated before sharded, no checkpointing) that fits within ``headroom`` of the device's memory (ties: fewer dimensions,
replicated before sharded), and names the runner-up. Context and expert parallel are kept as the user gives them,
not chosen (the measured step gives no attention or routing split to cost them by).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from torch import nn

from cuboid.planning.estimate import _ring  # (the same alpha-beta ring as the formula planner's)
from cuboid.planning.measured import Profile

GIB = 2**30


@dataclass(frozen=True)
class Device:
    """What a rank has: its memory, dense FLOP/s at the run's math, and its links (bytes/s, seconds per step)."""

    name: str
    memory: float
    flops: float
    link_intra: float
    link_inter: float
    alpha: float = 20e-6
    per_node: int = 8


@dataclass(frozen=True)
class Choice:
    """One costed layout."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    ac: str | None
    microbatches: int
    replicated: bool  # DDP's all-reduce (no sharding)
    batch: int = 1  # samples per data-parallel rank and step (the loader's)
    cpu_offload: bool = False
    parts: dict[str, float] = field(default_factory=dict)  # device bytes per rank by kind
    host: float = 0.0  # bytes per rank that cpu_offload keeps in host memory
    step_peak: float = 0.0  # bytes per rank while the optimizer steps (its temporaries beside every gradient)
    seconds: float = 0.0
    fits: bool = False

    @property
    def memory(self) -> float:
        """The rank's peak: forward and backward's, or the optimizer step's where that is higher."""
        return max(sum(self.parts.values()), self.step_peak)

    @property
    def samples_per_s(self) -> float:
        """Samples the whole job trains per second (each data-parallel rank its own batch)."""
        return self.dp_replicate * self.dp_shard * self.batch / self.seconds if self.seconds else 0.0

    @property
    def dims(self) -> int:
        return sum(1 for d in (self.pp, self.tp, self.cp) if d > 1)

    def prediction(self) -> dict[str, float]:
        """Bytes per rank: ``peak`` (what the device must hold), ``optimizer step`` (the step's peak), and the
        forward and backward's peak by kind."""
        return {"peak": self.memory, "optimizer step": self.step_peak, **self.parts}

    def describe(self) -> str:
        dp = (f"dp_replicate={self.dp_replicate * self.dp_shard} (replicated, DDP's all-reduce)" if self.replicated
              else f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}")  # fmt: skip
        sizes = [f"pp={self.pp}", dp] + [f"cp={self.cp}"] * (self.cp > 1) + [f"tp={self.tp}"]
        extra = f", {self.microbatches} micro-batches" if self.pp > 1 else ""
        extra += ", cpu_offload" if self.cpu_offload else ""
        return f"{' x '.join(sizes)}, activation checkpointing {self.ac or 'off'}{extra}"

    def arguments(self) -> dict[str, Any]:
        """The CuboidStrategy arguments that make this layout."""
        args: dict[str, Any] = {"pipeline_parallel": self.pp, "tensor_parallel": self.tp}
        if self.replicated:
            args["data_parallel_replicate"], args["data_parallel_shard"] = self.dp_replicate * self.dp_shard, 1
        else:
            args["data_parallel_replicate"], args["data_parallel_shard"] = self.dp_replicate, self.dp_shard
        if self.cp > 1:
            args["context_parallel"] = self.cp
        if self.ac:
            args["activation_checkpointing"] = self.ac
        if self.pp > 1:
            args["microbatches"] = self.microbatches
        if self.cpu_offload:
            args["cpu_offload"] = True
        return args


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(module: nn.Module, tp: int) -> bool:
    """A tensor-parallel plan resolves for ``module`` and every weight it splits divides by ``tp``."""
    from cuboid.parallel import resolve_plan

    try:
        matched = resolve_plan(module, None, tp)
    except Exception:  # noqa: BLE001  (no plan: tensor parallel is not a candidate)
        return False
    if not matched:
        return False
    for sub, _style in matched.values():
        for p in sub.parameters(recurse=False):
            if p.dim() >= 1 and any(s % tp for s in p.shape[:2]):
                return False
    return True


def _pp_ok(module: nn.Module, blocks: list[tuple[str, nn.Module]], pp: int) -> bool:
    from cuboid.pipeline import find_pipeline_split

    if pp > len(blocks):
        return False
    try:
        find_pipeline_split(module, blocks)
    except Exception:  # noqa: BLE001  (no cut: pipeline parallel is not a candidate)
        return False
    return True


def _param_bytes(module: nn.Module, blocks: list, pp: int, dp_shard: int, tp: int, stored: int) -> tuple[int, int]:
    """(this layout's largest per-rank parameter shard bytes, the same stage unsharded over dp), as setup counts."""
    from cuboid.measure import estimate
    from cuboid.parallel import Layout, resolve_plan

    matched = resolve_plan(module, None, tp) if tp > 1 else {}
    pipelining = SimpleNamespace(enabled=pp > 1, pp=pp, virtual_stages=1, split=None, schedule="1F1B")
    est = estimate(module, Layout(pp=pp, dp_shard=dp_shard, tp=tp), matched, blocks, pipelining, stored)
    worst = max(range(len(est.per_pp_rank)), key=est.rank_bytes)
    return est.per_pp_rank[worst], est.unsharded_per_pp_rank[worst]


def cost(
    profile: Profile,
    module: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    device: Device,
    pp: int,
    dp_replicate: int,
    dp_shard: int,
    tp: int,
    cp: int = 1,
    ac: str | None = None,
    replicated: bool = False,
    microbatches: int = 1,
    stored: int = 4,
    headroom: float = 0.9,
    cpu_offload: bool = False,
) -> Choice:
    """Memory per rank and seconds per step of one layout (the module docstring's model)."""
    compute = profile.compute_bytes
    shards = 1 if replicated else dp_shard * cp
    local, stage = _param_bytes(module, blocks, pp, shards, tp, stored)
    trained = profile.trainable / max(profile.params, 1)
    parts: dict[str, float] = {"parameters": local, "gradients": local * trained}
    parts["optimizer"] = local * trained * profile.optimizer_per_trainable
    n_blocks = max(len(profile.units), 1)
    unit = max((u.param_bytes for u in profile.units), default=0) / tp * stored / compute
    stage_blocks = math.ceil(len(profile.units) / pp) if profile.units else 0
    root = max(0.0, stage - stage_blocks * unit)  # the stage's parameters outside its blocks (unsharded)
    if replicated:
        parts["buckets"] = parts["gradients"]  # DDP's gradient buckets: a second copy of every gradient
    elif shards > 1:
        # the root unit stays gathered for the step, twice over: FSDP2's all-gather output and the unsharded
        # parameters copied out of it (measured: a dense net's peak holds both); under pp the whole stage
        gathered = 2 * root if pp == 1 else stage
        parts["gathered"] = (gathered + (2 * unit if pp == 1 else 0)) * compute / stored + unit * trained
    micro = profile.samples / microbatches
    in_flight = min(microbatches, pp) if pp > 1 else 1
    block_act = profile.block_activation_bytes
    other_act = max(0.0, profile.activation_bytes - block_act)
    recomputed = 0.0  # full checkpointing: one block's set, made again while its backward runs
    if ac == "full" and profile.units:
        block_act = sum(u.input_bytes for u in profile.units)  # what stays of each block: its input
        recomputed = max(u.activation_bytes for u in profile.units)
    stage_share = stage_blocks / n_blocks if profile.units else 1.0
    per_sample = block_act * stage_share / tp / cp + other_act / (tp if tp > 1 else 1) / cp
    parts["activations"] = per_sample * micro * in_flight
    # backward's peak: its temporaries (the loss's gradient first) or, under full checkpointing, a recomputed block
    parts["temporaries"] = max(profile.temp_bytes, recomputed) * micro / (tp * cp)
    seconds = _seconds(profile, device, pp, dp_replicate * dp_shard, tp, cp, ac, replicated, microbatches, local,
                       stage, unit, stored)  # fmt: skip
    persistent = parts["parameters"] + parts["gradients"] + parts["optimizer"] + parts.get("buckets", 0.0)
    step_peak = persistent + profile.step_temp_bytes * local / max(stage, 1) * stored / compute
    host = 0.0
    if cpu_offload:  # the shards, their gradients and the optimizer's state live on the host; units come and go
        host = sum(parts.pop(k) for k in ("parameters", "gradients", "optimizer"))
        step_peak = 0.0  # the update runs on the host
        seconds += 3 * host / 25e9  # across PCIe each step (as the formula planner)
    choice = Choice(pp, dp_replicate, dp_shard, tp, cp, ac, microbatches, replicated, profile.samples, cpu_offload,
                    parts, host, step_peak, seconds)  # fmt: skip
    return replace(choice, fits=choice.memory <= headroom * device.memory)


def _seconds(profile: Profile, d: Device, pp: int, dp: int, tp: int, cp: int, ac: str | None, replicated: bool,
             m: int, local: float, stage: float, unit: float, stored: int) -> float:  # fmt: skip
    from cuboid.planning.planner import CALIBRATION

    flops = profile.flops * profile.samples * (4 / 3 if ac == "full" else 1.0) / (tp * cp * pp)
    compute = flops / (d.flops * CALIBRATION["efficiency"])
    span = dp * tp * cp
    bw = d.link_intra if span <= d.per_node else d.link_inter
    trained = profile.trainable / max(profile.params, 1)
    if replicated:  # DDP's all-reduce of the gradients
        comm = 2 * _ring(dp, stage * trained, bw, d.alpha)
    else:  # FSDP's all-gathers of the parameters, forward and backward, and the gradients' reduce-scatter
        comm = 2 * _ring(dp * cp, stage, bw, d.alpha) + _ring(dp * cp, stage * trained, bw, d.alpha)
    exposed = max(0.0, comm - compute) + comm / max(len(profile.units), 1)  # the first block's is never hidden
    tp_time = 0.0
    if tp > 1:
        per = sum(u.input_bytes for u in profile.units) * profile.samples / cp
        tp_time = 8 * _ring(tp, per, d.link_intra, d.alpha) * (1.5 if ac == "full" else 1.0)
    bubble = (compute + tp_time) * (pp - 1) / (m + pp - 1) if pp > 1 else 0.0
    optimizer = local * (2 + trained * (1 + profile.optimizer_per_trainable)) * 2 / max(d.flops / 100, 1.0)
    return compute + exposed + tp_time + bubble + optimizer


def choose(
    profile: Profile,
    module: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    world: int,
    device: Device,
    given: dict[str, int] | None = None,
    stored: int = 4,
    headroom: float = 0.9,
    nodes: int = 1,
    host_memory: float = 2e12,
) -> list[Choice]:
    """Every layout of ``world`` ranks for the module, fitting ones fastest first, then the rest smallest first.
    ``given``: what the user passed, kept as it is: sizes (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``,
    ``cp``), ``ac`` (activation checkpointing) and ``cpu_offload``.
    When nothing fits, the sharded layouts are tried again with ``cpu_offload`` (within ``host_memory`` bytes per
    node)."""
    given = dict(given or {})
    per_node = max(world // max(nodes, 1), 1)
    out: list[Choice] = []
    cp = given.get("cp", 1)
    for tp in _divisors(min(world // cp, per_node)):
        if "tp" in given and tp != given["tp"] or tp > 1 and not _tp_ok(module, tp):
            continue
        for pp in _divisors(world // (tp * cp)):
            if "pp" in given and pp != given["pp"] or pp > 1 and not _pp_ok(module, blocks, pp):
                continue
            dp = world // (tp * cp * pp)
            for rep in _divisors(dp):
                shard = dp // rep
                if "dp_replicate" in given and rep != given["dp_replicate"]:
                    continue
                if "dp_shard" in given and shard != given["dp_shard"]:
                    continue
                forms = [False] if pp > 1 or tp > 1 or cp > 1 or rep > 1 else [True, False]
                for replicated in forms:
                    if replicated and dp == 1 and world > 1:
                        continue
                    if not replicated and rep > 1 and nodes % rep:
                        continue
                    for ac in [given["ac"]] if "ac" in given else [None, "full"] if profile.units else [None]:
                        for m in _microbatches(profile.samples, pp):
                            offload = bool(given.get("cpu_offload")) and not replicated
                            out.append(cost(profile, module, blocks, device, pp, rep, shard, tp, cp, ac, replicated,
                                            m, stored, headroom, cpu_offload=offload))  # fmt: skip
    if not any(c.fits for c in out) and "cpu_offload" not in given:  # only then: offload costs every step
        out += [cost(profile, module, blocks, device, c.pp, c.dp_replicate, c.dp_shard, c.tp, c.cp, c.ac, False,
                     c.microbatches, stored, headroom, cpu_offload=True) for c in out if not c.replicated]  # fmt: skip
        out = [c for c in out if not c.cpu_offload or c.host * per_node <= host_memory]
    fitting = sorted((c for c in out if c.fits), key=lambda c: -c.samples_per_s)
    if fitting:  # within 5% of the fastest the simpler wins: fewer dimensions, replicated before sharded, no AC
        near = [c for c in fitting if c.samples_per_s >= 0.95 * fitting[0].samples_per_s]
        near.sort(key=lambda c: (c.dims, c.cpu_offload, not c.replicated, c.ac is not None, -c.samples_per_s))
        fitting = near + [c for c in fitting if c not in near]
    rest = sorted((c for c in out if not c.fits), key=lambda c: c.memory)
    return fitting + rest


def _microbatches(samples: int, pp: int) -> list[int]:
    """Micro-batch counts a pipeline may split the loader's batch into: divisors of the batch, at least ``pp``."""
    if pp == 1:
        return [1]
    return [m for m in _divisors(samples) if m >= pp][:3]  # none: the batch is too small to pipeline


def explain(options: list[Choice], profile: Profile) -> str:
    """Setup's lines: the choice with its predicted memory and step time, and the runner-up."""
    best = options[0]
    line = (f"Cuboid layout auto: {best.describe()}: predicted {best.memory / GIB:.3g} GiB per rank "
            f"({_parts(best)}), {best.seconds:.3g} s per step at {profile.samples} samples per data-parallel rank")  # fmt: skip
    if len(options) > 1 and options[1].fits:
        other = options[1]
        line += f"; runner-up {other.describe()}: {other.memory / GIB:.3g} GiB, {other.seconds:.3g} s"
    return line


def _parts(c: Choice) -> str:
    return ", ".join(f"{k} {v / GIB:.3g}" for k, v in c.parts.items() if v)


def nothing_fits(options: list[Choice], profile: Profile, device: Device, world: int) -> str:
    """The error when no layout fits: the nearest, what it needs, and the ways out."""
    near = options[0]
    need = near.memory / 0.9
    return (
        f"layout='auto': no layout of {world} ranks fits {profile.name} at {profile.samples} samples per rank on "
        f"{device.name} ({device.memory / GIB:.3g} GiB per rank). The nearest, {near.describe()}, needs "
        f"{near.memory / GIB:.3g} GiB per rank ({_parts(near)}), {need / GIB:.3g} GiB with the 10% the allocator "
        f"keeps. Use about {math.ceil(world * need / device.memory)} ranks, a smaller batch per rank, cpu_offload=True "
        "or precision='bf16-true'. Nothing was allocated."
    )


__all__ = ["Choice", "Device", "choose", "cost", "explain", "nothing_fits"]
