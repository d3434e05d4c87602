"""Where a layout is decided: the pp x dp_replicate x dp_shard x cp x tp sizes and the device mesh.

One :class:`Layout` per run. :meth:`Layout.resolve` fills ``"auto"`` and checks the sizes
against the world size before any process group exists; :func:`build_device_mesh` turns it
into one ``DeviceMesh`` with dims ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``, outermost to
innermost (torchtitan's order), so tensor-parallel peers are neighbouring ranks (the fastest links) and
context-parallel peers the next nearest. :class:`ParallelDims` is the one record of a run's layout: the degrees,
resolved against the world size, the meshes built from them, and the questions the rest of Cuboid asks ("which
ranks read different data?"); context parallel, the pipeline, the expert wiring and both doors read their degrees
there and keep none of their own (torchtitan's ``ParallelDims`` is the pattern).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cuboid.compat import flatten_mesh, name_mesh, unflatten_mesh

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DP_DIMS: tuple[str, str] = ("dp_replicate", "dp_shard")  # data parallel = replicas x shards
# FSDP shards over dp_shard x cp: cp ranks hold different tokens of the same sequences, so for the weights they
# are data-parallel peers (torchtitan's dp_shard_cp).
SHARD_CP_DIMS: tuple[str, str] = ("dp_shard", "cp")
# Every name the mesh answers to: its dims, then the flattened views build_device_mesh adds (the aliases last).
MESH_NAMES: tuple[str, ...] = (*MESH_DIMS, "dp", "dp_shard_cp", "dp_cp", "data_parallel", "tensor_parallel")
# Every rank that holds different tokens of a step: data parallel x cp (a batch statistic's sum runs over them).
TOKEN_DIMS: tuple[str, str, str] = (*DP_DIMS, "cp")
# Flattened views -> the dims they cover (what the global grad norm needs to tell replicas from shards). The
# expert-parallel mesh (build_ep_meshes) splits dp_shard x cp into "efsdp" x "ep": both cover those two dims.
FLATTENED: dict[str, tuple[str, ...]] = {
    "dp": DP_DIMS,
    "dp_shard_cp": SHARD_CP_DIMS,
    "dp_cp": TOKEN_DIMS,
    "efsdp": SHARD_CP_DIMS,
    "ep": SHARD_CP_DIMS,
}


class LayoutError(ValueError):
    """A layout that cannot work: the message names the sizes and the fix."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Sizes of the five mesh dimensions, by keyword, in the mesh's order (outermost first):
    ``Layout(pp=2, dp_shard=4, tp=2)``. ``dp_shard="auto"`` fills the rest of the world. ``ep``: the ranks each MoE
    layer's experts are split over, borrowed from ``dp_shard x cp`` (not a dimension of its own)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int | Literal["auto"] = "auto"
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def resolve(self, world_size: int) -> Layout:
        """Return the layout with ``"auto"`` filled, or raise :class:`LayoutError`."""
        for name in ("pp", "dp_replicate", "tp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{_ARG_NAMES[name]} must be a positive integer, got {value!r}.")
        fixed = self.pp * self.dp_replicate * self.tp * self.cp
        cp = f" x context_parallel ({self.cp})" if self.cp > 1 else ""
        if self.dp_shard == "auto":
            if world_size % fixed != 0:
                raise LayoutError(
                    f"Cannot fill data_parallel_shard='auto': pipeline_parallel ({self.pp}) x "
                    f"data_parallel_replicate ({self.dp_replicate}){cp} x tensor_parallel ({self.tp}) = {fixed} "
                    f"does not divide the world size {world_size}. Choose sizes whose product divides "
                    f"{world_size} (devices x num_nodes)."
                )
            return replace(self, dp_shard=world_size // fixed).resolve(world_size)
        if not isinstance(self.dp_shard, int) or isinstance(self.dp_shard, bool) or self.dp_shard < 1:
            raise LayoutError(f"data_parallel_shard must be a positive integer or 'auto', got {self.dp_shard!r}.")
        if fixed * self.dp_shard != world_size:
            raise LayoutError(
                f"The layout pipeline_parallel ({self.pp}) x data_parallel_replicate ({self.dp_replicate}) x "
                f"data_parallel_shard ({self.dp_shard}){cp} x tensor_parallel ({self.tp}) = {fixed * self.dp_shard} "
                f"processes, but the world size (devices x num_nodes) is {world_size}. Change one size so the "
                f"product is {world_size}, or set data_parallel_shard='auto'."
            )
        self._check_ep()
        return self

    def _check_ep(self) -> None:
        assert isinstance(self.dp_shard, int)
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise LayoutError(f"expert_parallel must be a positive integer, got {self.ep!r}.")
        if self.ep == 1:
            return
        within = self.dp_shard * self.cp
        if within % self.ep:
            raise LayoutError(
                f"expert_parallel={self.ep} must divide data_parallel_shard ({self.dp_shard}) x context_parallel "
                f"({self.cp}) = {within}: experts are split over ranks that read different data. Choose an "
                f"expert_parallel that divides {within}, or a larger data_parallel_shard."
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas x shards): how many different batches a step sees."""
        assert isinstance(self.dp_shard, int), "resolve() the layout first"
        return self.dp_replicate * self.dp_shard

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """The sizes in :data:`MESH_DIMS` order: ``(pp, dp_replicate, dp_shard, cp, tp)``."""
        assert isinstance(self.dp_shard, int), "resolve() the layout first"
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def degrees(self) -> dict[str, int]:
        """Every degree by name, ``ep`` included: what a checkpoint records of the layout it was saved on."""
        assert isinstance(self.dp_shard, int), "resolve() the layout first"
        return {**dict(zip(MESH_DIMS, self.sizes, strict=True)), "ep": self.ep}

    def describe(self) -> str:
        """``pp=1 x dp_replicate=1 x dp_shard=4 x tp=2`` (``cp=`` only where it is above 1; ``, ep=N`` likewise)."""
        dims = " x ".join(f"{n}={s}" for n, s in zip(MESH_DIMS, self.sizes, strict=True) if n != "cp" or s > 1)
        return dims + (f", experts over ep={self.ep}" if self.ep > 1 else "")


# Each degree's argument in the doors, for messages (cuboid.parallel.BuildSettings.make builds the layout from them).
_ARG_NAMES = {
    "pp": "pipeline_parallel",
    "dp_replicate": "data_parallel_replicate",
    "dp_shard": "data_parallel_shard",
    "tp": "tensor_parallel",
    "cp": "context_parallel",
}


def build_device_mesh(layout: Layout, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """Build the 5-D mesh for a resolved layout, and the flattened data-parallel mesh.

    The flattened ``dp`` mesh (dp_replicate x dp_shard, named ``"dp"``) is what the data
    sampler, loss and metric reduction use. The mesh also answers to Lightning's
    ModelParallelStrategy names, so a ``configure_model`` written for it runs unchanged:
    ``mesh["data_parallel"]`` (= dp) and ``mesh["tensor_parallel"]`` (= tp). Cuboid keeps every flattened view
    it makes and finds it with :func:`submesh` (torch deprecates looking them up on the root mesh). A view over the
    same ranks as a dim or another view shares its process group (:func:`_view`, ``compat.name_mesh``), but for
    ``dp_shard_cp`` under cp (FSDP's all-gathers keep a communicator apart from cp's exchange).
    """
    mesh = init_device_mesh(device_type, layout.sizes, mesh_dim_names=MESH_DIMS)
    spans: dict[tuple[str, ...], DeviceMesh] = {}  # the dims of more than one rank a view covers -> the view
    dp = _view(mesh, DP_DIMS, "dp", spans)
    # FSDP's all-gathers under cp get a communicator of their own, not cp's (its K/V exchange would queue behind
    # FSDP's prefetches on one NCCL communicator; torchtitan keeps dp_shard_cp apart too)
    if layout.cp > 1:
        shard_cp = flatten_mesh(mesh[SHARD_CP_DIMS], "dp_shard_cp")
    else:
        shard_cp = _view(mesh, SHARD_CP_DIMS, "dp_shard_cp", spans)
    views: dict[str | tuple[str, ...], DeviceMesh] = {
        "dp": dp,
        "dp_shard_cp": shard_cp,
        "dp_cp": _view(mesh, TOKEN_DIMS, "dp_cp", spans),  # dp without cp, cp without dp
        "data_parallel": name_mesh(dp, "data_parallel"),  # the same ranks as dp: its process group, not a new one
        "tensor_parallel": name_mesh(mesh["tp"], "tensor_parallel"),
    }
    if layout.dp_replicate > 1 and layout.cp > 1:  # HSDP with cp: FSDP's 2-D mesh over replicas x (shards x cp)
        every = views["dp_cp"]
        sizes = (layout.dp_replicate, layout.dp_shard * layout.cp)  # type: ignore[operator]
        views[("dp_replicate", "dp_shard_cp")] = unflatten_mesh(every, sizes, ("dp_replicate", "dp_shard_cp"))
    mesh.cuboid_views = views  # type: ignore[attr-defined]  # the bookkeeping torch asks for, kept on the root
    return mesh, views["dp"]


def _view(mesh: DeviceMesh, dims: tuple[str, ...], name: str, spans: dict[tuple[str, ...], DeviceMesh]) -> DeviceMesh:
    """``dims`` as one named 1-D mesh. A new process group (one more NCCL communicator) only where two or more of
    them span several ranks and no view in ``spans`` covers the same ones; otherwise that view, or the one dim that
    spans (or the last), answers under the new name, over its own group: ``dp`` is ``dp_shard`` without replicas,
    ``dp_cp`` is ``dp`` without cp."""
    spanning = tuple(d for d in dims if mesh[d].size() > 1)
    if spanning in spans:
        return name_mesh(spans[spanning], name)
    view = (
        flatten_mesh(mesh[dims], name)
        if len(spanning) > 1
        else name_mesh(mesh[spanning[0] if spanning else dims[-1]], name)
    )
    spans[spanning] = view
    return view


def submesh(mesh: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
    """``mesh[names]``, where a flattened view that :func:`build_device_mesh` made is returned as kept, not looked
    up on the root mesh (torch's deprecated path)."""
    kept = getattr(mesh, "cuboid_views", {})
    return kept[names] if names in kept else mesh[names]


def build_ep_meshes(mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The meshes expert parallel uses: ``dp_shard x cp`` split into ``efsdp x ep`` (the ``ep`` ranks innermost),
    one more ``DeviceMesh`` over the same ranks (torchtitan borrows EP from the same dims). Returns the 1-D ``ep``
    mesh, over which each MoE layer's experts are split, and the mesh FSDP shards the experts over: ``efsdp``, the
    ranks holding the same experts (with ``dp_replicate`` for HSDP)."""
    pp, dp_replicate, dp_shard, cp, tp = mesh.mesh.shape
    ranks = mesh.mesh.reshape(pp, dp_replicate, dp_shard * cp // ep, ep, tp)
    names = ("pp", "dp_replicate", "efsdp", "ep", "tp")
    root = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=names)
    experts_fsdp = root["dp_replicate", "efsdp"] if dp_replicate > 1 else root["efsdp"]
    return root["ep"], experts_fsdp


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D ``dp_shard``, or 2-D ``(dp_replicate, dp_shard)`` for HSDP; with context
    parallel, ``dp_shard_cp`` (dp_shard x cp flattened) in place of ``dp_shard``."""
    shard = "dp_shard_cp" if mesh["cp"].size() > 1 else "dp_shard"
    if mesh["dp_replicate"].size() > 1:
        return submesh(mesh, ("dp_replicate", shard))
    return submesh(mesh, shard)


def check_reshard_after_forward(value: bool | int, dp_shard: int | str) -> None:
    """``reshard_after_forward`` is a bool, or a divisor of ``dp_shard`` strictly between 1 and it."""
    if isinstance(value, bool):
        return
    assert isinstance(dp_shard, int)
    if not isinstance(value, int) or not (1 < value < dp_shard and dp_shard % value == 0):
        raise LayoutError(
            f"reshard_after_forward={value!r} must be True, False or a divisor of data_parallel_shard={dp_shard} "
            f"strictly between 1 and {dp_shard} (e.g. the number of GPUs per node)."
        )


def dim_groups(mesh: Any, names: Sequence[str]) -> list[tuple[str, Any]]:
    """(name, its process group) for each of ``names`` the mesh answers to (dims and flattened views), in order;
    names it does not know are left out."""
    found = []
    for name in names:
        try:
            found.append((name, submesh(mesh, name).get_group()))
        except (KeyError, RuntimeError, ValueError):
            continue
    return found


@dataclass(frozen=True)
class ExpertsLayout:
    """Where the experts of MoE layers go: split over ``ep_mesh``, FSDP over ``fsdp_mesh`` (the ranks holding the
    same experts), their gradients divided by ``dp`` (every data-parallel rank's tokens reach them)."""

    ep_mesh: DeviceMesh
    fsdp_mesh: DeviceMesh
    dp: int


class ParallelDims:
    """A run's degrees and, once the processes exist, its meshes.

    Made with the degrees as asked (``dp_shard`` may be ``"auto"``); :meth:`resolve` fills ``"auto"`` from the world
    size (or raises :class:`~cuboid.parallel.mesh.LayoutError`, naming the sizes and the fix) and :meth:`build` makes
    the device mesh, its data-parallel view and, under expert parallel, the experts' meshes."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._mesh: DeviceMesh | None = None
        self._dp_mesh: DeviceMesh | None = None
        self.experts: ExpertsLayout | None = None  # under ep > 1: the meshes each MoE layer's experts use

    # ------------------------------------------------------------------ degrees (read by Pipelining and ContextParallel)
    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    def resolve(self, world_size: int) -> Layout:
        """Fill ``"auto"`` from ``world_size`` and keep the result; raise ``LayoutError`` for sizes that cannot
        work."""
        self.layout = self.layout.resolve(world_size)
        return self.layout

    # ------------------------------------------------------------------ meshes (once the process group exists)
    def build(self, device_type: str) -> None:
        """The resolved layout's device mesh, its ``dp`` view and, under ``ep > 1``, the experts' meshes."""
        layout = self.layout
        self._mesh, self._dp_mesh = build_device_mesh(layout, device_type)
        if layout.ep > 1:
            self.experts = ExpertsLayout(*build_ep_meshes(self._mesh, layout.ep), layout.dp * layout.cp)

    @property
    def built(self) -> bool:
        return self._mesh is not None

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``."""
        if self._mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have started (setup_environment).")
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel ranks (dp_replicate x dp_shard flattened) as a 1-D mesh named ``"dp"``."""
        if self._dp_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have started (setup_environment).")
        return self._dp_mesh

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks that read different batches and share this rank's pp, cp and tp coordinates."""
        return self.dp_mesh.get_group()

    def token_groups(self) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """(name, group) of the ranks that hold different tokens of a step, as one group (``dp_cp``: data parallel
        x cp, one collective for a sum over all of them), and of cp alone (its ranks hold different parts of the
        same sequences)."""
        return dim_groups(self.mesh, ("dp_cp",)), dim_groups(self.mesh, ("cp",))
