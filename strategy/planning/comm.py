"""What the communication ledger should read: the analytic bytes per optimizer step of each collective kind per mesh
dimension for Cuboid's Llama with its plan (:func:`expected`), set beside what
:class:`cuboid.measure.CommLedger` counts by ``python scripts/bench.py --suite comm`` and the ledger's tests."""

from __future__ import annotations

from typing import Any

from cuboid.planning.estimate import dtype_bytes, rank_params, rank_stages


def expected(shape: Any, setup: Any, pp_rank: int = 0, backend: str = "nccl") -> dict[str, dict[str, float]]:
    """The analytic bytes per optimizer step on a rank of pipeline rank ``pp_rank``, in the ledger's convention,
    for Cuboid's Llama with its plan (``shape``: :class:`cuboid.planning.estimate.Shape`, ``setup``: its ``Setup``):

    * FSDP (``dp_shard``): every unit gathered in forward (the stage's parameters, tp-local), the blocks again in
      backward but the last (not resharded), none again under pp (kept gathered); gradients reduce-scattered once
      per unit, in the reduce dtype (an all-reduce of the full gradient on gloo, which has no reduce-scatter).
    * HSDP (``dp_replicate``): the reduced gradient shards all-reduced across replicas.
    * TP (``tp``, sequence parallel): per block and micro-batch 2 all-gathers and 2 reduce-scatters of ``b s h`` in
      forward and as many in backward (4 more under full checkpointing), plus one each at the embedding (first
      stage) and at the output (last stage); once per step, the gradients of the norm weights (replicated over
      tp, each rank's a partial sum: 2 per block, the final norm on the last stage) all-reduced; on the last stage
      per micro-batch, loss parallel's three all-reduces of one float32 per token (the logits' maximum, the sum
      of their exponentials, the target's logit), or under pp, where the plan's loss parallel becomes a gathered
      output, the logits all-gathered (``b s vocab``).
    * CP (``cp``): per block and micro-batch, the whole sequence's K and V all-gathered (the model's own KV heads,
      this tp rank's share; again in a full recompute) and their gradients reduce-scattered back (an all-reduce on
      gloo's ledger, as above); on the last stage, the per-token losses (float32) gathered per micro-batch. FSDP
      then shards over ``dp_shard_cp`` (dp_shard x cp) and is booked there.
    * PP (``pp``): each micro-batch's activation and its gradient across each stage boundary this rank has.
    * Mixture of experts: at ``ep`` 1 the experts are part of their block's unit. At ``ep`` > 1 they are FSDP units
      of their own over ``efsdp`` (this rank's ``experts / ep``, gathered and reduced like the blocks), and per MoE
      block and micro-batch the exchange's all-to-alls (``ep``): the pair counts (``experts`` int64), each pair's
      row to its expert's rank and the result back, and the same two in backward (again in the recompute under
      full checkpointing): ``4 x top_k x b s h`` when routing is balanced. A rank's own share depends on the
      routing (it sends ``top_k x b s h`` and receives what the others route to its experts); the mean over the
      ranks equals the figure. With ``setup.balance`` (the load-balancing loss summed over the ranks), per MoE
      block and forward (again in an activation-checkpointing recompute) its ``2 x experts + 1`` float32 parts
      all-reduced over each of ``dp_replicate``, ``dp_shard`` and ``cp`` that has more than one rank.
    """
    _, c, r = dtype_bytes(setup.precision)
    rs = "all_reduce" if backend == "gloo" else "reduce_scatter"
    sharded, replicated, _, blocks = rank_params(shape, setup)[pp_rank]
    stage = sharded / setup.tp + replicated
    block = shape.block_tp / setup.tp + shape.block_norms + shape.block_router + shape.block_experts
    out: dict[str, dict[str, float]] = {}
    if shape.experts and setup.ep > 1:  # the experts leave the blocks' units for their own, over efsdp
        stage, block = stage - blocks * shape.block_experts, block - shape.block_experts
        out.update(_experts_terms(shape, setup, blocks, c, r, rs))
    if setup.dp_shard * setup.cp > 1:  # FSDP shards over dp_shard, or dp_shard x cp (dp_shard_cp) under cp
        backward = 0 if setup.pp > 1 else (blocks - 1) * block
        out[_fsdp_dim(setup)] = {"all_gather": (stage + backward) * c, rs: stage * r}
    if setup.dp_replicate > 1:
        out["dp_replicate"] = {"all_reduce": stage / setup.dp_shard * r}
    n_stages = setup.pp * setup.virtual_stages
    stages = rank_stages(setup)[pp_rank]
    act = setup.batch / setup.m * setup.seq / setup.cp * shape.dim * c  # one micro-batch's b s h (this cp rank's s)
    if setup.tp > 1:
        last = n_stages - 1 in stages
        ends = (0 in stages) + last
        per = 4 * blocks + (2 * blocks if setup.ac == "full" else 0) + ends
        norms = (2 * blocks + last) * shape.dim * c
        tokens = setup.batch / setup.m * setup.seq / setup.cp  # of one micro-batch, on this cp rank
        loss = 3 * tokens * 4 if last else 0  # loss parallel's statistics (the logits are never gathered)
        out["tp"] = {"all_gather": per * act * setup.m, rs: per * act * setup.m}
        if rs == "all_reduce":  # gloo: the reduce-scatters are all-reduces too
            out["tp"]["all_reduce"] += norms + loss * setup.m
        else:
            out["tp"]["all_reduce"] = norms + loss * setup.m
    if setup.cp > 1:  # each block's K and V (the model's own KV heads, tp-local), gathered whole over cp
        micro = setup.batch / setup.m
        kv = micro * setup.seq * shape.kv_dim / setup.tp * c
        # in forward, again in backward (only this rank's K and V are kept), and in a full recompute
        gathers = 2 * blocks * (3 if setup.ac == "full" else 2)
        losses = micro * setup.seq * 4 if n_stages - 1 in stages else 0  # the per-token losses (float32), last stage
        cp = out.setdefault("cp", {})  # (FSDP's too when cp is the whole world: see _fsdp_dim)
        cp["all_gather"] = cp.get("all_gather", 0.0) + (gathers * kv + losses) * setup.m
        cp[rs] = cp.get(rs, 0.0) + 2 * blocks * kv * setup.m
    if shape.experts and setup.balance:
        parts = blocks * (2 * shape.experts + 1) * 4 * setup.m * (2 if setup.ac else 1)
        for dim, size in (("dp_replicate", setup.dp_replicate), ("dp_shard", setup.dp_shard), ("cp", setup.cp)):
            if size > 1:
                out.setdefault(dim, {})["all_reduce"] = out.get(dim, {}).get("all_reduce", 0.0) + parts
    if setup.pp > 1:
        boundaries = sum((st > 0) + (st < n_stages - 1) for st in stages)
        out["pp"] = {"send_recv": 2 * boundaries * act * setup.m / setup.tp}
    return out


def _fsdp_dim(setup: Any) -> str:
    """The mesh dimension the ledger books FSDP's collectives to: ``dp_shard``; under cp ``dp_shard_cp``, unless cp
    is the whole world: both are then torch's default group, which the ledger names by its first dimension, ``cp``."""
    if setup.cp == 1:
        return "dp_shard"
    return "cp" if setup.cp == setup.world else "dp_shard_cp"


def _experts_terms(shape: Any, setup: Any, blocks: int, c: int, r: int, rs: str) -> dict[str, dict[str, float]]:
    """Expert parallel's part of :func:`expected`: the experts' own FSDP units over efsdp, and the all-to-alls."""
    out: dict[str, dict[str, float]] = {}
    local = shape.block_experts / setup.ep  # one block's experts on this rank
    efsdp = setup.dp_shard * setup.cp // setup.ep
    if efsdp > 1:
        backward = 0 if setup.pp > 1 else (blocks - 1) * local
        out["efsdp"] = {"all_gather": (blocks * local + backward) * c, rs: blocks * local * r}
    tokens = setup.batch / setup.m * setup.seq / setup.cp  # this rank's tokens of one micro-batch
    exchanges = 3 if setup.ac == "full" else 2  # forward, backward, and the recompute's forward
    per_block = exchanges * (2 * tokens * shape.top_k * shape.dim * c) + (exchanges - 1) * 8 * shape.experts
    out["ep"] = {"all_to_all": per_block * blocks * setup.m}
    return out
