"""What a strategy is asked to build, as one frozen, typed record: :class:`BuildSettings`.

Each door (the Trainer's :class:`cuboid.CuboidStrategy`, Fabric's :class:`cuboid.fabric.CuboidStrategy`) makes one
from its own arguments, keyword by keyword (:meth:`BuildSettings.make`), when it is made: the degrees become a
:class:`~cuboid.parallel.mesh.Layout` (``ep`` included), each setting is checked once and its default resolved in
one place. The record then goes whole to what builds the model; nothing reads the arguments again by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Literal

from cuboid.parallel.mesh import Layout
from cuboid.parallel.parallelize import ACMode, check_ac_mode
from cuboid.parallel.styles import check_plan_styles

WEIGHTS_INIT = ("auto", "rank0", "local")


@dataclass(frozen=True, kw_only=True)
class BuildSettings:
    """A strategy's layout and how it parallelizes the model, checked: see :meth:`make` for what each one means."""

    layout: Layout  # the degrees as asked (dp_shard may be "auto"; resolved against the world size at start)
    replicate_if_it_fits: bool = False  # data_parallel_shard left unset: replicated (DDP) where the model fits
    tensor_parallel_plan: Mapping[str, str] | None = None
    block_container: str | None = None
    activation_checkpointing: ACMode | None = None
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    compile: bool = False
    pretrained: Mapping[str, str] = field(default_factory=dict)
    load_balancing: str = "global"
    expert_bias_rate: float | None = None  # the experts' bias (aux-loss-free balancing), by this step; None: off
    weights_init: str = "auto"
    defer_reductions: str | None = "replicas"
    process_group_backend: str | None = None
    timeout: timedelta | None = None
    layout_auto: bool = False  # layout="auto": sizes not given chosen at setup from the measured module
    device_memory: float | None = None  # bytes per device the auto layout plans for (None: the device's own)
    given: frozenset[str] = frozenset()  # the degrees the user gave (kept by layout="auto")

    @property
    def dp_shard_auto(self) -> bool:
        """Whether the data-parallel shard degree fills what the other degrees leave (``"auto"``, or left unset)."""
        return self.layout.dp_shard == "auto"

    @classmethod
    def make(
        cls,
        *,
        pipeline_parallel: int,
        data_parallel_replicate: int,
        data_parallel_shard: int | Literal["auto"] | None,
        tensor_parallel: int,
        context_parallel: int,
        expert_parallel: int,
        tensor_parallel_plan: Mapping[str, str] | None,
        block_container: str | None,
        activation_checkpointing: ACMode | None,
        reshard_after_forward: bool | int | None,
        cpu_offload: bool,
        compile: bool,
        pretrained: Mapping[str, str | Path | None] | None,
        load_balancing: str,
        weights_init: str,
        defer_reductions: str | None,
        process_group_backend: str | None,
        timeout: timedelta | float | None,
        layout: str | None = None,
        device_memory: float | str | None = None,
        expert_bias_rate: float | None = None,
    ) -> BuildSettings:
        """The record of a door's arguments, every one given, named as the doors name them (their docstrings say
        what each does).
        ``data_parallel_shard=None``: sharded over what the other degrees leave, or replicated where the model
        fits (the Trainer's default). ``reshard_after_forward=None``: resharded after forward without pipeline
        parallel; kept gathered under it, where each block runs forward for every microbatch before its backward
        (torchtitan: ``reshard_after_forward = not pp``). Raises ``ValueError`` (a ``PlanError`` for a plan's
        styles) naming the argument and what to pass instead."""
        check_ac_mode(activation_checkpointing)
        check_plan_styles(tensor_parallel_plan)
        auto = layout == "auto"
        if layout not in (None, "auto"):
            raise ValueError(f"layout={layout!r}: use 'auto' (chosen at setup from the model) or None (the sizes as "
                             "given, the rest filled by data_parallel_shard).")  # fmt: skip
        given = {name for name, value, default in (
            ("pp", pipeline_parallel, 1), ("dp_replicate", data_parallel_replicate, 1), ("tp", tensor_parallel, 1),
            ("cp", context_parallel, 1), ("dp_shard", data_parallel_shard, None)) if value != default}  # fmt: skip
        if weights_init not in WEIGHTS_INIT:
            raise ValueError(f"weights_init={weights_init!r}: choose 'auto', 'rank0' or 'local'.")
        if weights_init == "local" and cpu_offload:
            raise ValueError(
                "weights_init='local' with cpu_offload=True: offloaded shards live in host memory, where DTensor has "
                "no random-number tracker. Use weights_init='rank0' (or 'auto', which chooses it under offload)."
            )
        layout = Layout(
            pp=pipeline_parallel,
            dp_replicate=data_parallel_replicate,
            dp_shard="auto" if data_parallel_shard is None else data_parallel_shard,
            cp=context_parallel,
            tp=tensor_parallel,
            ep=expert_parallel,
        )
        return cls(
            layout=layout,
            replicate_if_it_fits=data_parallel_shard is None,
            tensor_parallel_plan=dict(tensor_parallel_plan) if tensor_parallel_plan is not None else None,
            block_container=block_container,
            activation_checkpointing=activation_checkpointing,
            reshard_after_forward=pipeline_parallel == 1 if reshard_after_forward is None else reshard_after_forward,
            cpu_offload=cpu_offload,
            compile=compile,
            pretrained={str(k): str(v) for k, v in (pretrained or {}).items() if v is not None},
            load_balancing=load_balancing,
            expert_bias_rate=expert_bias_rate,
            weights_init=weights_init,
            defer_reductions=defer_reductions,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout) if isinstance(timeout, int | float) else timeout,
            layout_auto=auto,
            device_memory=parse_bytes(device_memory),
            given=frozenset(given - {"dp_shard"} if data_parallel_shard == "auto" else given),
        )


def parse_bytes(value: float | str | None) -> float | None:
    """``8e9``, ``"80GB"``, ``"64GiB"`` as bytes."""
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    text = str(value).strip().lower().replace(" ", "")
    for unit, scale in (("gib", 2**30), ("mib", 2**20), ("gb", 1e9), ("mb", 1e6)):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * scale
            except ValueError:
                break
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"device_memory={value!r}: give bytes, or a size like '80GB' or '64GiB'.") from None
