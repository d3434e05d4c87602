"""What a layout costs before it runs: per-GPU memory and step time of a Llama-shaped decoder, by formula.

Memory, per rank, on the fullest pipeline stage (AdamW; FSDP2 keeps sharded parameters in their own dtype, fp32
under ``bf16-mixed``, and gathers them in the compute dtype):

* persistent: parameters, gradients and the two AdamW moments, each ``stage parameters / (dp_shard x cp x tp)``
  (norm weights are replicated over ``tp``, as Cuboid's plans leave them), dtype bytes each: 16 B per parameter in
  fp32 or ``bf16-mixed``, 8 B in ``bf16-true``. ``cpu_offload`` moves all three to host memory.
* gathered: FSDP2's unsharded copies in the compute dtype: two blocks in flight (this one and the prefetched
  next), their unsharded gradients in the reduce dtype, and the stage root's embedding / output matrices. Under
  pp the whole stage stays gathered, with unsharded gradients, from the first micro-batch to the last (torch's
  pipeline stage turns resharding after backward and gradient sync off in between).
* activations, per micro-batch and block, counted tensor by tensor from what autograd keeps for the reference
  Llama (RMSNorm's fp32 upcast, rotary in fp32, SDPA's q, k, v, output and log-sum-exp, SwiGLU's three ``ffn``-wide
  tensors): ``30 bsh + 8 bs kv + 8 bsf`` bytes in bf16 (``b`` sequences, ``s`` tokens, ``h`` dim, ``kv`` the
  key/value width, ``f`` the ffn width). Selective checkpointing keeps matmul and attention outputs only
  (``10 bsh + 4 bs kv + 4 bsf``); full keeps each block's input (``2 bsh``) plus one block's full set while it is
  recomputed. A model that repeats its KV heads before attention (``Setup.repeat_kv``, torchtitan's Llama) has
  attention save q_dim-wide keys and values (``4 bs (q - kv)`` more in the full set). Sequence parallelism divides
  all of it by ``tp``, context parallelism by ``cp`` (a rank holds ``s / cp`` tokens of each sequence; its gathered
  keys and values, ``2 b s kv`` while one block runs, ``kv`` the exchanged width, are added). A 1F1B stage holds
  up to ``pp`` micro-batches.
* logits: the last stage's ``b s V / (tp cp)`` logits in the compute dtype, their fp32 copy for the loss and its
  gradient (10 B per logit in bf16); under ``tp`` loss parallel's log-softmax (torch's
  ``tensor.parallel.loss._log_softmax``, elementwise in fp32) holds the shifted logits and their exponent beside
  its fp32 input: 14 B.

Step time: the matmul FLOPs (6 x matmul parameters x tokens, ``ANCHORS.md``, plus what checkpointing recomputes:
each block's forward under full, every second block matmul under torchtitan's op-level selective) at ``peak x
efficiency`` (times the compile and float8 speed-ups where on), plus the attention kernels' FLOPs as a causal
flash kernel executes them (``2 x layers x q_dim x seq`` per token forward, 2.5 times that backward, the forward
again under full checkpointing; not the MFU convention's ``12 x layers x q_dim x seq``) at ``peak x
attention_efficiency`` (no compile or float8 gain: neither changes the flash kernel), plus the exposed part of each
collective, each costed with an alpha-beta model on the link it crosses: NVLink when its group lies within a node
(``tp`` is innermost), the network otherwise. FSDP's all-gathers and reduce-scatters overlap compute (exposed: what
exceeds it, plus the first block's); tensor parallel's run in the critical path (asynchronous TP hides
``async_tp`` of them); the pipeline adds its bubble ``(p - 1) / (m + p - 1)``, divided by ``v`` when interleaved.
Context parallel (:func:`_context_parallel`), in the critical path: Cuboid's block attention all-gathers each
block's keys and values in forward (again when full checkpointing recomputes) and backward and reduce-scatters
their gradients (it does not overlap them); torch's ring attention (``Setup.cp_rotate``, as torchtitan runs it)
moves the same keys and values, passes fp32 key/value gradients around the ring ``cp`` times, and at each of its
``cp`` steps merges the output and accumulates the gradients in fp32, HBM traffic counted at the HBM's bandwidth.
Both are balanced (head-tail chunks: every rank does ``1 / cp`` of the causal work).

Mixture of experts (``Shape.experts > 0``): FLOPs follow the active parameters (``top_k`` experts per token);
persistent bytes count every expert, sharded over ``dp_shard x cp`` as the rest (expert parallel borrows those
ranks, so ``ep`` does not change them); FSDP gathers a block's experts over ``efsdp = dp_shard x cp / ep`` only, so
the gathered experts per rank and their all-gather traffic fall as ``1 / ep``; the activations take ``top_k``
experts' width for the feed-forward's plus each pair's routed row and result (an estimate, not measured); expert
parallel adds, per MoE block and micro-batch, four all-to-alls of ``top_k x b s h`` (six under full checkpointing)
in the critical path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cuboid.planning.shapes import GIB, GPUS, Hardware, Setup, Shape

__all__ = ["GIB", "GPUS", "Hardware", "Setup", "Shape"]  # (re-exported: the estimate's inputs)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the fullest stage."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    logits: float
    host: float  # moved to host memory by cpu_offload
    imbalance: float  # the fullest stage's total / the mean stage's (pipeline stage imbalance)

    @property
    def persistent(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.persistent + self.gathered + self.activations + self.logits


def dtype_bytes(precision: str) -> tuple[int, int, int]:
    """(stored parameter, compute, gradient reduce) bytes per element."""
    if precision == "32-true":
        return 4, 4, 4
    if precision == "bf16-true":
        return 2, 2, 2
    return 4, 2, 4  # bf16-mixed: fp32 shards, bf16 compute, fp32 reduce (Cuboid's MixedPrecisionPolicy)


def stage_blocks(shape: Shape, stages: int) -> list[int]:
    """Blocks per pipeline stage, as even as they go (the first stages take one more)."""
    per, extra = divmod(shape.layers, stages)
    return [per + (1 if stage < extra else 0) for stage in range(stages)]


def rank_stages(s: Setup) -> list[list[int]]:
    """The stages each pp rank runs (Cuboid's own assignment, :func:`cuboid.pipeline.stages.stage_ids`)."""
    from cuboid.pipeline import stage_ids

    return [stage_ids(r, s.pp, s.virtual_stages, s.schedule) for r in range(s.pp)]


def rank_params(shape: Shape, s: Setup) -> list[tuple[int, int, int, int]]:
    """Per pp rank: (tp-sharded, tp-replicated, root matrix parameters, blocks). The embedding goes with the first
    stage, norm and output with the last (a tied matrix is held by both when they are different stages). An MoE
    block's router and experts count as tp-replicated (expert parallel splits them over ``dp_shard x cp`` ranks
    that FSDP shards over anyway: the persistent bytes per rank do not change with ``ep``)."""
    n_stages = s.pp * s.virtual_stages
    blocks = stage_blocks(shape, n_stages)
    out = []
    for stages in rank_stages(s):
        root, replicated, n_blocks = 0, 0, 0
        for stage in stages:
            n_blocks += blocks[stage]
            if stage == 0:
                root += shape.vocab * shape.dim
            if stage == n_stages - 1:
                replicated += shape.dim
                if not (shape.tied and n_stages == 1):
                    root += shape.vocab * shape.dim
        replicated += n_blocks * (shape.block_norms + shape.block_router + shape.block_experts)  # not split by tp
        out.append((n_blocks * shape.block_tp + root, replicated, root, n_blocks))
    return out


def _activation_bytes_per_block(shape: Shape, b: int, seq: int, ac: str | None, compute: int, tp: int,
                                repeat_kv: bool = False) -> float:  # fmt: skip
    """What autograd keeps for one block and micro-batch (the module docstring's count), scaled from bf16."""
    bsh, bskv, bsf = b * seq * shape.dim, b * seq * shape.kv_dim, b * seq * shape.ffn_active
    repeated = 4 * b * seq * (shape.q_dim - shape.kv_dim) if repeat_kv else 0  # attention's saved K, V at q_dim
    scale = compute / 2
    routed = 4 * shape.top_k * bsh if shape.experts and ac != "full" else 0  # each pair's row in and result out
    if ac == "full":
        kept = 2 * bsh
    elif ac == "selective":  # Cuboid's: every matmul and attention output kept, the rest recomputed
        kept = 10 * bsh + 4 * bskv + 4 * bsf
    elif ac == "selective_op":  # torchtitan's: the same but every second matmul recomputed (wq, wv, w1, w2 kept)
        kept = 8 * bsh + 2 * bskv + 2 * bsf
    else:
        kept = 30 * bsh + 8 * bskv + 8 * bsf + repeated
    whole = 0.0
    if shape.experts and ac != "full":  # an MoE feed-forward runs whole on every tp rank: its part is not split
        whole = {"selective": 4, "selective_op": 2}.get(ac, 8) * bsf + routed
        kept -= {"selective": 4, "selective_op": 2}.get(ac, 8) * bsf
    return (kept / tp + whole) * scale


def memory(shape: Shape, s: Setup) -> Memory:
    """Per-GPU bytes of training ``shape`` with setup ``s`` on its fullest stage (see the module docstring)."""
    per_stage = [rank_memory(shape, s, stage) for stage in range(s.pp)]
    worst = max(per_stage, key=lambda m: m.total)
    mean = sum(m.total for m in per_stage) / len(per_stage)
    return replace(worst, imbalance=worst.total / mean if mean else 1.0)


def rank_memory(shape: Shape, s: Setup, stage: int) -> Memory:
    """Per-GPU bytes on the ranks of pipeline rank ``stage`` (every rank when ``pp == 1``)."""
    stored, compute, reduce = dtype_bytes(s.precision)
    sharded, replicated, root, n_blocks = rank_params(shape, s)[stage]
    shards = s.dp_shard * s.cp  # FSDP shards over dp_shard x cp
    n = sharded / (s.tp * shards) + replicated / shards
    params, grads, opt = n * stored, n * stored, 2 * n * stored
    host = 0.0
    if s.cpu_offload:
        host, params, grads, opt = params + grads + opt, 0.0, 0.0, 0.0
    # FSDP gathers a block's experts over efsdp only: this rank's dim-0 block of them, experts / ep
    block = shape.block_tp / s.tp + shape.block_norms + shape.block_router + shape.block_experts / s.ep
    if s.pp > 1:  # the stage keeps its parameters gathered and accumulates unsharded gradients until the last
        # micro-batch (torch's pipeline stage: no resharding after backward, no gradient sync in between)
        held = sharded / s.tp + replicated - n_blocks * shape.block_experts * (1 - 1 / s.ep)
        gathered = held * (compute + reduce)
    elif shards > 1:
        gathered = 2 * block * compute + 2 * block * reduce + root / s.tp * compute
    else:
        gathered = 0.0
    micro, local = s.batch / s.m, s.seq / s.cp
    per_block = _activation_bytes_per_block(shape, micro, local, s.ac, compute, s.tp, s.repeat_kv)
    acts = per_block * n_blocks * _in_flight(s, stage) / s.virtual_stages
    if s.ac == "full":  # one block's full set while it is recomputed for backward
        acts += _activation_bytes_per_block(shape, micro, local, None, compute, s.tp, s.repeat_kv)
    if s.cp > 1:  # the whole sequence's keys and values, gathered while one block's attention runs
        width = shape.q_dim if s.repeat_kv else shape.kv_dim
        acts += 2 * micro * s.seq * width / s.tp * compute
    last = s.pp * s.virtual_stages - 1
    holds_output = any(st == last for st in rank_stages(s)[stage])
    loss_parallel = 4 if s.tp > 1 else 0  # its log-softmax holds the shifted logits and their exponent in fp32 too
    logits = micro * local * shape.vocab / s.tp * (compute + 4 + 4 + loss_parallel) if holds_output else 0.0
    return Memory(params, grads, opt, gathered, acts, logits, host, 1.0)


def _in_flight(s: Setup, rank: int) -> float:
    """Micro-batches whose activations a pp rank holds at its peak, in units of its whole stage set (a virtual
    stage's chunk counts 1 / v): 1F1B ``pp - rank``; interleaved, Megatron-LM's warm-up ``2 (pp - rank - 1) +
    (v - 1) pp`` chunks plus one; GPipe all of them."""
    if s.pp == 1:
        return 1.0
    if s.schedule == "GPipe":
        return float(s.m)
    if s.virtual_stages == 1:
        return float(min(s.m, s.pp - rank))
    chunks = 2 * (s.pp - rank - 1) + (s.virtual_stages - 1) * s.pp + 1
    return min(s.m * s.virtual_stages, chunks) / 1.0


@dataclass(frozen=True)
class StepTime:
    compute: float
    fsdp: float  # exposed
    hsdp: float
    tp: float
    cp: float
    bubble: float
    p2p: float
    optimizer: float
    tokens_per_gpu: float  # tokens of one optimizer step per GPU (global tokens / world)
    ep: float = 0.0  # expert parallel's all-to-alls
    attention: float = 0.0  # the attention kernels' share of compute (not added again in total)

    @property
    def total(self) -> float:
        parts = (self.compute, self.fsdp, self.hsdp, self.tp, self.cp, self.bubble, self.p2p, self.optimizer, self.ep)
        return sum(parts)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_gpu / self.total


def _ring(size: int, nbytes: float, bandwidth: float, alpha: float) -> float:
    """An all-gather or reduce-scatter of ``nbytes`` (the full, gathered size) over a ring of ``size`` ranks."""
    if size <= 1:
        return 0.0
    return (size - 1) * alpha + nbytes * (size - 1) / size / bandwidth


def _link(hw: Hardware, span: int) -> tuple[float, float]:
    """(bandwidth, alpha) of a group whose ranks are ``span`` apart in the world at most (mesh order pp, dp_replicate,
    dp_shard, tp: inner groups are neighbours)."""
    return (hw.nvlink, hw.alpha_nvlink) if span <= hw.gpus_per_node else (hw.network, hw.alpha_network)


def _recompute_flops_per_token(shape: Shape, s: Setup) -> float:
    """Matmul FLOPs per token that activation checkpointing repeats: full, each block's forward; torchtitan's
    op-level selective, every second block matmul; Cuboid's selective, none (attention's share:
    :func:`_attention_flops_per_token`)."""
    block_forward = 2 * shape.block_tp * shape.layers
    if s.ac == "full":
        return block_forward
    if s.ac == "selective_op":
        return block_forward / 2
    return 0.0


def _attention_flops_per_token(shape: Shape, s: Setup) -> float:
    """FLOPs per token the causal attention kernels execute (FlashAttention's own count, not the MFU convention's
    ``12 x layers x q_dim x seq``): forward ``2 x layers x q_dim x seq`` (QK^T and PV over the causal half, ``seq / 2``
    keys on average; a masked block is skipped), backward 2.5 times that (it recomputes QK^T: five matmuls to the
    forward's two), and the forward again where full checkpointing recomputes it (selective keeps the attention
    output)."""
    forward = 2 * shape.layers * shape.q_dim * s.seq
    return forward * (3.5 + (1.0 if s.ac == "full" else 0.0))


def step_time(shape: Shape, s: Setup, hw: Hardware, efficiency: float, compile_gain: float = 1.0,
              fp8_gain: float = 1.0, attention_efficiency: float | None = None) -> StepTime:  # fmt: skip
    """Seconds per optimizer step and tokens/s per GPU. ``efficiency``: the fraction of peak the matmuls reach
    (calibrated, see cuboid.planning.planner); ``compile_gain`` and ``fp8_gain``: speed-ups of the matmul part with
    ``torch.compile`` and float8 matmuls; ``attention_efficiency``: the fraction of the (bf16) peak the causal
    attention kernels reach on the FLOPs they execute (None: ``efficiency``). Neither gain applies to attention:
    float8 converts ``nn.Linear`` only, and compiling leaves the flash kernel as it is."""
    _, compute_b, reduce_b = dtype_bytes(s.precision)
    tokens_dp = s.batch * s.seq  # per data-parallel rank and step
    per_token = shape.flops_per_token(0) + _recompute_flops_per_token(shape, s)  # matmuls (6 x parameters, ...)
    whole = 6 * shape.layers * (3 * shape.dim * shape.ffn_active + shape.experts * shape.dim) if shape.experts else 0
    flops = ((per_token - whole) / s.tp + whole) * tokens_dp / (s.pp * s.cp)  # MoE feed-forwards whole on tp ranks
    attn_flops = _attention_flops_per_token(shape, s) / s.tp * tokens_dp / (s.pp * s.cp)  # heads split over tp
    math_kind = "fp32" if s.precision == "32-true" else "bf16"
    speed = hw.peak[math_kind] * efficiency * (compile_gain if s.compile else 1.0) * (fp8_gain if s.fp8 else 1.0)
    attention_speed = hw.peak[math_kind] * (efficiency if attention_efficiency is None else attention_efficiency)
    attention = attn_flops / attention_speed
    compute = flops / speed + attention
    # FSDP: all-gather in forward (and again in backward when resharding), reduce-scatter of gradients.
    ranks = rank_params(shape, s)
    stage = max(sharded / s.tp + replicated for sharded, replicated, _, _ in ranks)
    blocks = max(n for *_, n in ranks)
    shards = s.dp_shard * s.cp
    bw, alpha = _link(hw, s.tp * shards)
    reshard = s.reshard_after_forward if s.reshard_after_forward is not None else s.pp == 1
    gather_b = 1 if s.fp8 else compute_b
    experts = blocks * shape.block_experts  # gathered over efsdp = shards / ep, this rank's experts / ep only
    dense = stage - experts

    def fsdp_ring(elem_bytes: int) -> float:
        calls = alpha * (blocks + 1)
        dense_part = _ring(shards, dense * elem_bytes, bw, calls)
        return dense_part + (_ring(shards // s.ep, experts / s.ep * elem_bytes, bw, calls) if experts else 0.0)

    gathers = (2 if reshard else 1) * fsdp_ring(gather_b)
    scatters = fsdp_ring(reduce_b)
    fsdp_total = gathers + scatters
    fsdp = max(0.0, fsdp_total - compute) + fsdp_total / max(blocks, 1)  # the first block's is never hidden
    bw_r, alpha_r = _link(hw, s.world // s.pp)
    hsdp = 2 * _ring(s.dp_replicate, stage / shards * reduce_b, bw_r, alpha_r) if s.dp_replicate > 1 else 0.0
    # Tensor parallel (sequence parallel): per block and micro-batch, 2 all-gathers + 2 reduce-scatters in forward
    # and 2 + 2 in backward, of b s h in the compute dtype; full checkpointing repeats the forward ones.
    bw_t, alpha_t = _link(hw, s.tp)
    per = _ring(s.tp, tokens_dp / s.cp / s.m * shape.dim * compute_b, bw_t, alpha_t)  # one collective, micro-batch
    tp = per * blocks * s.m * (8 + (4 if s.ac == "full" else 0)) if s.tp > 1 else 0.0
    if s.async_tp:
        tp *= 0.5
    cp = _context_parallel(shape, s, hw, tokens_dp, blocks, compute_b) if s.cp > 1 else 0.0
    bubble = p2p = 0.0
    if s.pp > 1:
        bubble = (compute + tp) * (s.pp - 1) / s.virtual_stages / s.m
        bw_p, alpha_p = _link(hw, s.world // s.pp * 2)
        act = tokens_dp / s.m * shape.dim * compute_b / (s.tp * s.cp)
        p2p = 2 * (s.pp - 1) * (alpha_p + act / bw_p)
    # Expert parallel: per MoE block and micro-batch, each token's top_k rows sent to their experts' ranks and the
    # results back, in forward and again in backward (and the forward pair again under full checkpointing), in
    # the critical path; (ep - 1) / ep of the rows leave the rank when routing is balanced.
    ep = 0.0
    if s.ep > 1 and shape.experts:
        bw_e, alpha_e = _link(hw, s.tp * s.ep)
        rows = tokens_dp / s.cp / s.m * shape.top_k * shape.dim * compute_b
        one = (s.ep - 1) * alpha_e + rows * (s.ep - 1) / s.ep / bw_e
        ep = one * blocks * s.m * (6 if s.ac == "full" else 4)
    optimizer = stage / shards * 16 * 2 / hw.hbm  # read and write params, grads and moments once
    tokens_per_gpu = tokens_dp * s.dp_replicate * s.dp_shard / s.world
    return StepTime(compute, fsdp, hsdp, tp, cp, bubble, p2p, optimizer, tokens_per_gpu, ep, attention)


def _context_parallel(shape: Shape, s: Setup, hw: Hardware, tokens_dp: int, blocks: int, compute_b: int) -> float:
    """Context parallel's exchange of keys and values and, for torch's ring attention, its per-step merges; in the
    critical path. ``width``: the exchanged K/V width, ``kv_dim``, or ``q_dim`` where the model repeats its KV heads
    before attention (``Setup.repeat_kv``, torchtitan's Llama).

    Cuboid's block attention (``cp_rotate=None``): per block and micro-batch, the whole sequence's K and V
    all-gathered in forward, again in backward (and in the recompute under full checkpointing), their gradients
    reduce-scattered; it does not overlap them.

    torch's ring (``torch.distributed.tensor.experimental.context_parallel``, as torchtitan ran it; ``cp_rotate``
    its rotate method): per block pass, the K/V all-gathered once (``"allgather"``) or passed on in ``cp - 1``
    point-to-point steps (``"alltoall"``), the same bytes; in backward again, and the K/V gradients, accumulated in
    fp32, passed on to the next rank ``cp`` times (fp32, point-to-point). Its collectives are functional ones,
    waited at once where the block is compiled (``_maybe_wrap_tensor`` under tracing), so they are counted exposed.
    Beside the kernels, the ring reads and writes HBM at every step (counted for its last rank, whose steps all
    merge whole outputs): per forward pass, ``cp - 1`` fp32 merges of the output by its log-sum-exp (38 B per output
    element: the output cast to fp32, three elementwise passes over fp32 operands); per backward pass, ``cp - 1``
    more flash calls than one (22 B per output element each: its output and output gradient made contiguous, its
    fp32 dQ accumulator), ``cp`` fp32 accumulations of dQ (10 B per output element) and of dK, dV (20 B per K/V
    element, 26 B where half of each is updated and concatenated back) and ``cp`` fp32 concatenations of dK, dV
    sent on (16 B); in each pass ``cp - 1`` concatenations of K and V sent on (8 B per K/V element)."""
    passes = 3 if s.ac == "full" else 2  # forward, the recompute under full checkpointing, backward
    width = shape.q_dim if s.repeat_kv else shape.kv_dim
    micro_tokens = tokens_dp / s.m  # one micro-batch's tokens of every sequence, all cp ranks together
    bw, alpha = _link(hw, s.tp * s.cp)
    kv_gathered = 2 * micro_tokens * width / s.tp * compute_b  # both K and V, the whole sequence
    gather = _ring(s.cp, kv_gathered, bw, alpha)
    if s.cp_rotate not in (None, "allgather", "alltoall"):
        raise ValueError(f"Setup.cp_rotate={s.cp_rotate!r}: None (Cuboid's), 'allgather' or 'alltoall' (torch's ring).")
    if s.cp_rotate is None:
        per_block = gather * passes + _ring(s.cp, kv_gathered, bw, alpha)  # + the gradients' reduce-scatter
        return per_block * blocks * s.m
    local_out = micro_tokens / s.cp * shape.q_dim / s.tp  # elements of this rank's attention output
    local_kv = micro_tokens / s.cp * width / s.tp  # elements of this rank's K (or V)
    grads = s.cp * (alpha + 2 * local_kv * 4 / bw)  # fp32 dK and dV to the next rank, cp times
    hbm_forward = (s.cp - 1) * (38 * local_out + 8 * local_kv)
    hbm_backward = (s.cp - 1) * (32 * local_out + 50 * local_kv) + 10 * local_out + 36 * local_kv
    merges = ((passes - 1) * hbm_forward + hbm_backward) / hw.hbm
    per_block = gather * passes + grads + merges
    return per_block * blocks * s.m


def fits(mem: Memory, hw: Hardware, headroom: float = 0.9) -> bool:
    """Within ``headroom`` of the GPU's memory (the allocator's cache and fragmentation take the rest)."""
    return mem.total <= headroom * hw.memory and not math.isnan(mem.total)
