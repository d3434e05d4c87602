"""Expert parallel's token exchange: every (token, expert) pair that a router chose goes to the rank that holds
that expert, and its result comes back, through two all-to-alls with uneven splits (gloo and NCCL take both).

Experts are split in contiguous blocks over the ``ep`` ranks of a group: rank ``r`` holds experts
``[r * E / ep, (r + 1) * E / ep)``. A pair whose expert index is ``E`` or more (transformers' sentinel for a pair
dropped by capacity or masked) goes nowhere and adds nothing.

One host sync per MoE layer and forward: the pair counts are exchanged first (a small all-to-all) and read back,
because the token all-to-all needs its splits on the host. The backward reuses them: no sync there. Nor does an
activation checkpoint's recompute: a checkpointed block's forward records each layer's counts
(:class:`RoutingReplay`, installed by ``cuboid.parallel.apply_ac``) and its recompute takes them back instead of
exchanging and reading them again (torchtitan's selective checkpointing saves the device-to-host copy for the same
reason; this also serves full checkpointing, and a CPU run, where the read is no op to save).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows with uneven splits; its backward is the reverse exchange. (torch's own
    autograd wrapper, ``torch.distributed.nn.functional.all_to_all_single``, is deprecated for a private one.)"""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _AllToAll.apply(grad.contiguous(), ctx.send, ctx.recv, ctx.group), None, None, None


def exchange(rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``send[r]`` consecutive rows to each rank ``r`` and receive ``recv[r]`` from each (differentiable)."""
    return _AllToAll.apply(rows, recv, send, group)


@dataclass
class RoutingReplay:
    """Each MoE layer's exchanged pair counts from one checkpointed forward (the host lists and the device tensor, in
    call order), taken back by its recompute: one count exchange and one host read per layer and forward, however
    often the block runs. Only ops outside selective checkpointing's save list are skipped in the recompute, so its
    cache of saved outputs keeps its order."""

    kept: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    taken: int = 0  # how many of them this recompute has taken back (each recompute replays them all: a zero-bubble
    # schedule recomputes a block twice, for its input gradients and for its weights')

    @contextmanager
    def recording(self) -> Generator[None, None, None]:
        token = _REPLAY.set((self, False))
        try:
            yield
        finally:
            _REPLAY.reset(token)

    @contextmanager
    def replaying(self) -> Generator[None, None, None]:
        self.taken = 0
        token = _REPLAY.set((self, True))
        try:
            yield
        finally:
            _REPLAY.reset(token)


_REPLAY: ContextVar[tuple[RoutingReplay, bool] | None] = ContextVar("cuboid_routing_replay", default=None)


def _exchanged_counts(
    counts_of: torch.Tensor, num_experts: int, group: dist.ProcessGroup
) -> tuple[list[int], torch.Tensor]:
    """Each expert's pair count here and each local expert's from every rank: ``(host list of 2 E, the received
    counts on the device)``; in a checkpoint's recompute, the forward's (:class:`RoutingReplay`)."""
    replay = _REPLAY.get()
    if replay is not None and replay[1] and replay[0].taken < len(replay[0].kept):
        replay[0].taken += 1
        return replay[0].kept[replay[0].taken - 1]
    counts = pairs_per_expert(counts_of, num_experts)
    recv_counts = torch.empty_like(counts)  # [source rank][my local expert]
    dist.all_to_all_single(recv_counts, counts, group=group)
    host = torch.cat([counts, recv_counts]).tolist()  # the one host sync: the splits below live on the host
    if replay is not None and not replay[1]:
        replay[0].kept.append((host, recv_counts))
    return host, recv_counts


class ExpertParallelError(ValueError):
    """An expert-parallel layout that cannot work: named sizes, and what to do."""


def expert_block(num_experts: int, ep: int, rank: int) -> tuple[int, int]:
    """The experts ``[start, stop)`` that ep rank ``rank`` holds of ``num_experts`` split over ``ep`` ranks."""
    if ep <= 0 or num_experts % ep:
        raise ExpertParallelError(
            f"expert_parallel={ep} does not divide the {num_experts} experts of each MoE layer: every rank must hold "
            f"the same number. Use an expert_parallel that divides {num_experts}."
        )
    per = num_experts // ep
    return rank * per, (rank + 1) * per


def pairs_per_expert(index: torch.Tensor, num_experts: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """How many (token, expert) pairs of ``index`` (expert ids, any shape) go to each of the ``num_experts``; ids of
    ``num_experts`` or more (dropped pairs) are not counted. On the device only: ``index_add_`` into an extra bin,
    where ``bincount`` or a boolean mask would read the device back on a GPU."""
    flat = index.detach().reshape(-1).clamp(max=num_experts)
    binned = torch.zeros(num_experts + 1, dtype=dtype, device=flat.device)
    return binned.index_add_(0, flat, torch.ones_like(flat, dtype=dtype))[:num_experts].contiguous()


@dataclass(frozen=True)
class Routed:
    """What ``dispatch`` sent, kept to bring the results back (``combine``)."""

    order: torch.Tensor  # the valid pairs (indices into top_k_index.reshape(-1)), sorted by expert: the send order
    pairs: int  # num_tokens * top_k
    send_splits: list[int]  # pairs sent to each ep rank
    recv_splits: list[int]  # pairs received from each ep rank
    regroup: torch.Tensor  # received rows -> grouped by local expert (source ranks in order within an expert)
    group: dist.ProcessGroup
    local_counts: torch.Tensor  # rows per local expert, on the device (a grouped GEMM's offsets, without a copy)


def dispatch(
    hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, list[int], Routed]:
    """Send each chosen (token, expert) pair's hidden state to the rank holding the expert.

    ``hidden``: ``(tokens, hidden)``; ``top_k_index``: ``(tokens, k)`` global expert ids. Returns the rows this rank
    must compute, grouped by its local experts in order, how many rows each local expert has, and the routing to
    undo it."""
    ep = dist.get_world_size(group)
    per = expert_block(num_experts, ep, 0)[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    host, recv_counts = _exchanged_counts(flat, num_experts, group)
    send_counts, received = host[:num_experts], host[num_experts:]
    send_splits = [sum(send_counts[r * per : (r + 1) * per]) for r in range(ep)]
    recv_splits = [sum(received[s * per : (s + 1) * per]) for s in range(ep)]
    order = order[: sum(send_splits)]  # sentinels sort last and are left out
    rows = hidden.index_select(0, torch.div(order, top_k_index.shape[-1], rounding_mode="floor"))
    got = exchange(rows, recv_splits, send_splits, group)
    regroup = _regroup_index(recv_counts.view(ep, per), sum(recv_splits))
    local_counts = [sum(received[s * per + e] for s in range(ep)) for e in range(per)]
    on_device = recv_counts.view(ep, per).sum(0)
    routed = Routed(order, flat.numel(), send_splits, recv_splits, regroup, group, on_device)
    return got.index_select(0, regroup), local_counts, routed


def _regroup_index(received: torch.Tensor, total: int) -> torch.Tensor:
    """Rows arrive as [source 0: expert 0's rows, expert 1's, ...][source 1: ...]; the local experts want
    [expert 0: source 0's rows, source 1's, ...][expert 1: ...]. The gather index that does it, made on the device
    from ``received`` (``(sources, local experts)`` row counts, where the all-to-all left them) and ``total`` (their
    sum, already on the host): no tensor is made on the host or copied over, and ``output_size`` spares
    ``repeat_interleave`` its own sync."""
    sizes = received.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(received)  # where each (source, expert) block arrived
    by_expert = received.t().reshape(-1)  # the blocks in the order the experts want them
    placed = torch.cumsum(by_expert, 0) - by_expert  # where each block goes
    shift = torch.repeat_interleave(starts.t().reshape(-1) - placed, by_expert, output_size=total)
    return torch.arange(total, device=received.device) + shift


def combine(results: torch.Tensor, top_k_weights: torch.Tensor, routed: Routed) -> torch.Tensor:
    """Bring each pair's expert output back to its token's rank, weight it, and sum each token's k pairs (in pair
    order, as transformers' grouped implementation does). Returns ``(tokens, hidden)``."""
    back = torch.empty_like(results).index_copy(0, routed.regroup, results)  # undo the regrouping
    mine = exchange(back, routed.send_splits, routed.recv_splits, routed.group)
    weights = top_k_weights.reshape(-1).index_select(0, routed.order).unsqueeze(-1)
    pairs = mine.new_zeros(routed.pairs, mine.shape[-1]).index_copy(0, routed.order, mine * weights.to(mine.dtype))
    return pairs.view(top_k_weights.shape[0], top_k_weights.shape[-1], -1).sum(dim=1)
