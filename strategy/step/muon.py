"""Muon across shards: each matrix's Newton-Schulz runs on the whole matrix, once, on one rank.

Muon (Jordan et al. 2024; torch 2.13's ``torch.optim.Muon``) keeps a momentum per matrix, elementwise, and steps
each weight matrix by an orthogonalized version of it: a few Newton-Schulz iterations ``X <- aX + (bA + cA^2)X``,
``A = X X^T``, on the whole matrix. Elementwise parts work on a shard as on the whole; the iteration does not: on
one shard of the rows it orthogonalizes those rows alone, another update. torch's Muon has no code for DTensors:
handed FSDP2's shards it runs the iteration through DTensor's implicit redistributions, every rank on every matrix.

Under Cuboid (every optimizer step either door runs) torch's Newton-Schulz function is answered by
:func:`whole_matrices` of it: for a matrix sharded over a mesh,

- the matrices are dealt over the ranks it is split over in turn (the owner of the ``i``-th matrix a step
  orthogonalizes on those ranks is their ``i mod n``-th; a dim it is replicated over, HSDP's replicas, is left
  out: each replica set orthogonalizes its own copy, with no traffic across replicas);
- **one gather** brings every rank's shard (its local values, padded to the largest shard) to the owner, which puts
  them where they sit in the whole matrix and runs the function there, once;
- **one scatter** sends each rank its shard of the result, in the parameter's dtype (a bfloat16 result, as torch's
  function gives, is exact in fp32).

Where each rank's values sit in the whole matrix (FSDP2's row shards, tensor parallel's columns or rows, both at
once, ``_StridedShard`` included) is read once per layout from DTensor itself: every rank distributes the whole
matrix's element indices as its parameter is distributed (``distribute_tensor(..., src_data_rank=None)``: its own
slice, no communication) and the owner gathers them (the first step's one extra gather per layout and owner, and one
host read of the shard sizes). A replicated matrix (DDP, tp's whole parameters) is orthogonalized where it is.

Bytes per matrix and step, ``n`` ranks, ``P`` the largest shard's elements, ``b`` the parameter's bytes per element:
the gather carries ``n x P x b`` (each rank's padded shard) and the scatter ``n x P x b`` (the owner's list), as the
communication ledger books them (``gather`` and ``scatter``).

:class:`Muon` is torch's ``Muon`` with the iteration's dtype as an argument: ``ns_dtype=torch.float32`` for runs
compared to one process within fp32's rounding (bfloat16's rounds to 8 bits: a difference of 1e-7 in a gradient
flips a bfloat16 digit now and then). A user's own Muon-style optimizer decorates its per-matrix function with
:func:`whole_matrices` and gets the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from cuboid import compat

# Keller Jordan's quintic coefficients and step count, torch.optim.Muon's defaults
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


class MuonError(ValueError):
    """Muon asked to step a parameter Cuboid cannot treat as a whole matrix: which one, and what to do."""


def newton_schulz(
    grad: Tensor,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """torch's ``_zeropower_via_newtonschulz`` (torch/optim/_muon.py) with the iteration's ``dtype`` as an argument:
    the matrix scaled to spectral norm at most 1 (Frobenius norm), transposed to wide, ``ns_steps`` quintic
    iterations, transposed back."""
    a, b, c = ns_coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class _Dealer:
    """The state of :func:`whole_matrices` on this rank: a group per mesh, whose turn it is, and the element indices
    each owner holds per layout (all deterministic: every rank of a mesh makes the same calls in the same order)."""

    def __init__(self) -> None:
        self.world: Any = None  # the default group the state below belongs to (a later run's starts afresh)
        self.groups: dict[tuple[int, ...], Any] = {}
        self.used: dict[
            str, tuple[str, int]
        ] = {}  # every group gathered over: name -> (what the ledger calls it, size)
        self.turns: dict[tuple[int, ...], int] = {}
        self.widths: dict[tuple, int] = {}  # layout -> the largest shard's elements
        self.indices: dict[tuple, list[Tensor]] = {}  # (layout, owner) -> each member's element indices (owner only)
        self.known: set[tuple] = set()  # (layout, owner) whose indices the owner has

    def fresh(self) -> _Dealer:
        """This state, emptied if the process group it was made under is gone (a fit after another: the old groups'
        names are handed out again)."""
        world = dist.group.WORLD if dist.is_initialized() else None
        if world is not self.world:
            self.__init__()
            self.world = world
        return self

    def group(self, mesh: Any, ranks: tuple[int, ...]) -> Any:
        names = mesh.mesh_dim_names or ("mesh",)
        if mesh.ndim == 1:
            group, label = mesh.get_group(), names[0]
        else:
            if ranks not in self.groups:  # the mesh's ranks as one group, made by those ranks alone
                desc = "muon_" + "_".join(names)
                self.groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True, group_desc=desc)
            group, label = self.groups[ranks], "muon_" + "_".join(names)
        self.used[group.group_name] = (label, group.size())
        return group


_DEALER = _Dealer()


def muon_groups() -> dict[str, tuple[str, int]]:
    """The groups :func:`whole_matrices` gathered over: name -> (the mesh dim's name, or ``muon_<dims>`` for the group
    it made over several, and size), for the communication ledger (a parameter's mesh may hold its own group for a
    dim the run's mesh names too)."""
    return dict(_DEALER.fresh().used)


def _sharded_mesh(mesh: Any, placements: tuple) -> Any:
    """The dims of ``mesh`` the matrix is split over (a replicated dim's ranks hold the same shard: HSDP's replicas
    gather among themselves alone); the whole mesh where its dims have no names."""
    names = mesh.mesh_dim_names
    split = [i for i, p in enumerate(placements) if not p.is_replicate()]
    if names is None or len(split) == mesh.ndim:
        return mesh
    return mesh[tuple(names[i] for i in split)]


def _element_indices(x: DTensor) -> Tensor:
    """This rank's elements of ``x``, as flat indices into the whole matrix (no communication)."""
    whole = torch.arange(x.numel(), device=x.to_local().device).view(x.shape)
    return distribute_tensor(whole, x.device_mesh, x.placements, src_data_rank=None).to_local().reshape(-1)


def _learn_layout(x: DTensor, layout: tuple, owner: int, members: list[int], group: Any) -> None:
    """Once per layout: every rank's largest-shard width; once per (layout, owner): the owner's index lists."""
    mine = _element_indices(x)
    if layout not in _DEALER.widths:
        width = torch.tensor([mine.numel()], device=mine.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
        _DEALER.widths[layout] = int(width.item())  # once per layout, on its first step
    width = _DEALER.widths[layout]
    padded = torch.full((width + 1,), -1, dtype=torch.long, device=mine.device)
    padded[0] = mine.numel()
    padded[1 : 1 + mine.numel()] = mine
    me = dist.get_rank()
    gathered = [torch.empty_like(padded) for _ in members] if me == owner else None
    dist.gather(padded, gathered, dst=owner, group=group)
    if me == owner:
        sizes = torch.stack([g[0] for g in gathered]).tolist()  # once per (layout, owner)
        _DEALER.indices[(layout, owner)] = [g[1 : 1 + n] for g, n in zip(gathered, sizes, strict=True)]
    _DEALER.known.add((layout, owner))


def _on_whole(fn: Callable[..., Tensor], x: DTensor, *args: Any, **kwargs: Any) -> DTensor:
    mesh, placements = x.device_mesh, tuple(x.placements)
    local = x.to_local()
    if all(p.is_replicate() for p in placements):  # every rank holds it whole: orthogonalized where it is
        out = fn(local, *args, **kwargs).to(local.dtype)
        return DTensor.from_local(out, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())
    if any(p.is_partial() for p in placements):
        raise MuonError(
            f"Muon was handed a matrix of shape {tuple(x.shape)} with partial placements {placements} (a sum not "
            "yet reduced): Cuboid orthogonalizes whole matrices only. Step this parameter with another optimizer."
        )
    _DEALER.fresh()
    sharded = _sharded_mesh(mesh, placements)  # HSDP's replicas each orthogonalize their own copy, no traffic across
    ranks = tuple(int(r) for r in sharded.mesh.flatten().tolist())
    members = sorted(ranks)
    group = _DEALER.group(sharded, ranks)
    turn = _DEALER.turns.get(ranks, 0)
    _DEALER.turns[ranks] = turn + 1
    owner = members[turn % len(members)]
    layout = (tuple(x.shape), placements, ranks)
    if (layout, owner) not in _DEALER.known:
        _learn_layout(x, layout, owner, members, group)
    width = _DEALER.widths[layout]
    device = local.device
    send = torch.zeros(width, dtype=local.dtype, device=device)
    send[: local.numel()] = local.reshape(-1)
    me = dist.get_rank()
    shards = [torch.empty_like(send) for _ in members] if me == owner else None
    dist.gather(send, shards, dst=owner, group=group)
    pieces = None
    if me == owner:
        indices = _DEALER.indices[(layout, owner)]
        whole = torch.empty(x.numel(), dtype=local.dtype, device=device)
        for shard, index in zip(shards, indices, strict=True):
            whole[index] = shard[: index.numel()]
        result = fn(whole.view(x.shape), *args, **kwargs).to(local.dtype).reshape(-1)
        pieces = [torch.zeros(width, dtype=local.dtype, device=device) for _ in members]
        for piece, index in zip(pieces, indices, strict=True):
            piece[: index.numel()] = result[index]
    mine = torch.empty(width, dtype=local.dtype, device=device)
    dist.scatter(mine, pieces, src=owner, group=group)
    out = mine[: local.numel()].view(local.shape)
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())


def whole_matrices(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` (a matrix -> a matrix of its shape: an orthogonalization) run on whole matrices. Its first argument,
    a DTensor sharded over ranks, is gathered to the rank whose turn it is, ``fn`` runs there, and each rank gets its
    shard of the result back (see the module docstring); a plain tensor goes to ``fn`` as it is. Decorate a
    Muon-style optimizer's per-matrix function with it; every rank of the matrix's mesh must call it alike."""
    if getattr(fn, "_cuboid_whole", False):
        return fn

    @functools.wraps(fn)
    def on_whole(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if isinstance(x, DTensor):
            return _on_whole(fn, x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    on_whole._cuboid_whole = True  # type: ignore[attr-defined]
    return on_whole


@contextmanager
def whole_matrix_steps() -> Any:
    """Around an optimizer step: torch's Muon orthogonalizes through :func:`whole_matrices`."""
    with compat.muon_newton_schulz(whole_matrices(compat.muon_newton_schulz.original)):
        yield


class Muon(torch.optim.Muon):
    """torch's ``torch.optim.Muon``, its Newton-Schulz iteration in ``ns_dtype`` (torch's: bfloat16;
    ``torch.float32`` for a run compared to one process), on whole matrices under Cuboid. Every other argument is
    torch's: 2-D parameters only (embeddings, norms, biases and the output layer go to another optimizer)."""

    def __init__(self, params: Iterable[Any], *args: Any, ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any):
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """torch's step, each matrix orthogonalized in :attr:`ns_dtype` (on the whole matrix where it is sharded)."""
        iteration = functools.partial(newton_schulz, dtype=self.ns_dtype)
        with compat.muon_newton_schulz(whole_matrices(iteration)):
            return compat.unhooked_step(torch.optim.Muon.step)(self, closure)


def refuse_muon_shapes(error: ValueError, named: Iterable[tuple[str, Tensor]]) -> Exception:
    """torch's Muon refusing a parameter that is not 2-D names its size only: the same refusal naming the
    parameters of that size (``named``: the module's), and what to do. Any other error comes back unchanged."""
    text = str(error)
    if "Muon only supports 2D parameters" not in text:
        return error
    size = text.rsplit(":", 1)[-1].strip()
    names = [name for name, p in named if p.dim() != 2 and str(p.shape) in size]
    which = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "") if names else "one"
    return MuonError(
        f"Muon steps matrices only, and configure_optimizers handed it {which} ({size}): Newton-Schulz "
        "orthogonalizes a 2-D weight. Give Muon the blocks' 2-D weights (p.ndim == 2) and the rest (embeddings, "
        "norms, biases, packed 3-D experts, the output layer) to AdamW, in a second optimizer or param group."
    )
