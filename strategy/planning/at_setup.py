"""``layout="auto"`` at setup, and offline: measure the module on one batch, cost every layout, choose.

:func:`plan_module` is what ``CuboidStrategy(layout="auto")`` runs in ``setup`` (every rank alike, before anything
is sharded) and what ``python -m cuboid.layout --module pkg.mod:Class`` runs on one process. It returns the
options (fitting ones fastest first) and the lines to print, or ``None`` options with the one line saying why the
module could not be measured (the strategy then keeps the memory-led default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cuboid.planning.auto import Choice, Device, choose, explain, nothing_fits
from cuboid.planning.measured import Profile, Unmeasured, describe, profile
from cuboid.planning.shapes import GPUS

# precision -> (stored bytes per parameter element, compute dtype of the step or None for the module's own)
PRECISIONS: dict[str, tuple[int, torch.dtype | None]] = {
    "32-true": (4, None), "32": (4, None), "bf16-mixed": (4, torch.bfloat16), "16-mixed": (4, torch.float16),
    "bf16-true": (2, torch.bfloat16), "16-true": (2, torch.float16),
}  # fmt: skip


def device_of(device: torch.device, procs_per_node: int, memory: float | None = None) -> Device:
    """A rank's device as the planner costs it: a GPU's memory and dense bf16 peak (its model matched in
    :data:`cuboid.planning.GPUS`, else the H100's), NVLink within a node and the network between; on CPU, the
    host's memory shared by the node's processes, a nominal 50 GFLOP/s per process and loopback links."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name.lower()
        hw = next((h for key, h in GPUS.items() if key.split("-")[0] in name), GPUS["h100"])
        return Device(props.name, memory or float(props.total_memory), hw.peak["bf16"], hw.nvlink, hw.network,
                      per_node=procs_per_node)  # fmt: skip
    host = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return Device("CPU", memory or host / max(procs_per_node, 1), 5e10, 5e9, 1e9, alpha=50e-6, per_node=procs_per_node)


@dataclass(frozen=True)
class Planned:
    """What :func:`plan_module` found: the measured profile (or why not), the options, and the lines to print."""

    profile: Profile | None
    options: list[Choice]
    lines: list[str]
    fallback: str | None = None  # why the memory-led default is kept

    @property
    def best(self) -> Choice | None:
        return self.options[0] if self.options and self.options[0].fits else None


def plan_module(
    lm: nn.Module,
    batch: Any,
    world: int,
    nodes: int,
    device: Device,
    given: dict[str, int] | None = None,
    precision: str = "32-true",
    block_container: str | None = None,
) -> Planned:
    """Measure ``lm``'s step on ``batch`` (fake tensors), cost every layout of ``world`` ranks on ``device``, and
    say what it chose. Raises :class:`~cuboid.parallel.LayoutError` when nothing fits, naming the nearest."""
    from cuboid.parallel import LayoutError, find_blocks

    stored, dtype = PRECISIONS.get(str(precision), (4, None))
    try:
        blocks = find_blocks(lm, block_container)
    except Exception as err:  # noqa: BLE001
        return _fallback(f"its blocks could not be found ({err})")
    measured = profile(lm, batch, blocks, dtype, foreach=device.name != "CPU")
    if isinstance(measured, Unmeasured):
        return _fallback(measured.reason)
    options = choose(measured, lm, blocks, world, device, given, stored, nodes=nodes)
    if not options:
        return _fallback("no layout of the world's ranks keeps the sizes given")
    if not options[0].fits:
        raise LayoutError(nothing_fits(options, measured, device, world))
    return Planned(
        measured, options, [f"Cuboid layout auto: measured {describe(measured)}", explain(options, measured)]
    )


def _fallback(reason: str) -> Planned:
    line = f"Cuboid layout auto: kept the memory-led default: the module could not be measured: {reason}."
    return Planned(None, [], [line], reason)


def table(options: list[Choice], limit: int = 30) -> str:
    """Every option, fitting ones fastest first: sizes, checkpointing, GiB per rank, seconds per step."""
    head = f"{'layout':<78} {'GiB/rank':>9} {'host GiB':>8} {'s/step':>8} {'samples/s':>10} {'fits':>4}"
    lines = [head, "-" * len(head)]
    for c in options[:limit]:
        lines.append(f"{c.describe():<78} {c.memory / 2**30:>9.3g} {c.host / 2**30:>8.3g} {c.seconds:>8.3g} "
                     f"{c.samples_per_s:>10.4g} {'yes' if c.fits else 'NO':>4}")  # fmt: skip
    return "\n".join(lines)


__all__ = ["PRECISIONS", "Planned", "device_of", "plan_module", "table"]
