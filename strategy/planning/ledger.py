"""The communication ledger: per optimizer step, the count and bytes of each collective kind per mesh dimension.

``Trainer(callbacks=[CommLedger()])`` (off by default; the main job's ``debug`` preset turns it on). It reads
torch's flight recorder, which Cuboid keeps on (``CuboidStrategy(flight_recorder=...)``): every collective this
rank issued since the previous step, with its process group's description (``mesh_tp``, ``mesh_dp_shard``, ...;
Cuboid's own gloo group is ``cuboid_host``), its kind and its tensors' sizes and dtypes. Bytes are those of the
full tensor: the gathered output of an all-gather, the input of a reduce-scatter, all-reduce or send/recv (so a
ring moves about ``(n - 1) / n`` of them per rank). On logging steps rank 0 logs ``comm/<dim>/<kind>_MB`` and
``comm/<dim>/<kind>_count`` to the Trainer's loggers (W&B in the main job). ``CommLedger.steps`` keeps every
step's table.

Cost: reading the recorder copies its ring (up to ``flight_recorder`` entries) once per optimizer step, on the
host; nothing touches the device. Meant for runs that look at communication, not for every production step.

Torch 2.13's recorder leaves gloo's send/recv out: on gloo with pipeline parallel the ledger counts the pipeline's
``c10d`` send and recv ops itself, with a ``TorchDispatchMode`` around each training batch (a Python call per op
in the step: a CPU debugging aid; on NCCL the recorder has them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import lightning as L

from cuboid import compat
from cuboid.parallel import dim_groups

DTYPE_BYTES = {"Float": 4, "Double": 8, "BFloat16": 2, "Half": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
               "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}  # fmt: skip


def kind_of(profiling_name: str) -> str:
    """A backend's op name (``gloo:all_gather``, ``nccl:_reduce_scatter_base``, ...) -> one of all_gather,
    reduce_scatter, all_reduce, all_to_all, send_recv, broadcast, other."""
    name = profiling_name.split(":")[-1].lower().replace("_", "")
    for key, kind in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
                      ("alltoall", "all_to_all"), ("send", "send_recv"), ("recv", "send_recv"),
                      ("broadcast", "broadcast")):  # fmt: skip
        if key in name:
            return kind
    return "other"


def entry_bytes(entry: dict[str, Any], kind: str, group_size: int) -> int:
    """Full-tensor bytes: an all-gather's input times the group's size (gloo records its output as the input's
    shape), any other collective's input."""
    total = 0
    for size, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False):
        total += math.prod(size) * DTYPE_BYTES.get(dtype, 4)
    return total * group_size if kind == "all_gather" else total


def mesh_groups(mesh: Any, experts: Any = None) -> dict[str, tuple[str, int]]:
    """Process-group name -> (mesh dimension, size), for this rank: the first dimension (pp, dp_replicate,
    dp_shard, tp, then the flattened dp; then expert parallel's ep and efsdp, from its own mesh) of size > 1 that
    uses it (``experts``: the strategy's :attr:`experts_layout`). A dimension as large as the world shares the
    default group."""
    found: dict[str, tuple[str, int]] = {}
    dims = [*dim_groups(mesh, ("pp", "dp_replicate", "dp_shard", "tp", "dp"))]
    if experts is not None:
        dims += dim_groups(experts.fsdp_mesh, ("efsdp",))
        ep = experts.ep_mesh.get_group()  # may be another dimension's group too: its all-to-alls are expert parallel's
        found[f"{ep.group_name}/all_to_all"] = ("ep", ep.size())
    for dim, group in dims:
        if group.size() > 1:
            found.setdefault(group.group_name, (dim, group.size()))
    return found


def tally(entries: list[dict[str, Any]], groups: dict[str, tuple[str, int]]) -> dict[str, dict[str, list[int]]]:
    """{dimension: {kind: [count, bytes]}} of the given flight-recorder entries (``groups``: :func:`mesh_groups`;
    other groups go by their description: ``default_pg`` is "world", Cuboid's gloo group "cuboid_host")."""
    table: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for entry in entries:
        kind = kind_of(str(entry.get("profiling_name", "")))
        name, desc = entry["process_group"]
        other = ({"default_pg": "world"}.get(desc, desc or name), 1)
        dim, size = groups.get(f"{name}/{kind}") or groups.get(name, other)
        cell = table[dim][kind]
        cell[0] += 1
        cell[1] += entry_bytes(entry, kind, size)
    return {dim: dict(kinds) for dim, kinds in table.items()}


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
    from cuboid.planning.estimate import dtype_bytes, rank_params, rank_stages

    _, c, r = dtype_bytes(setup.precision)
    rs = "all_reduce" if backend == "gloo" else "reduce_scatter"
    sharded, replicated, _, blocks = rank_params(shape, setup)[pp_rank]
    stage = sharded / setup.tp + replicated
    block = shape.block_tp / setup.tp + shape.block_norms + shape.block_router + shape.block_experts
    out: dict[str, dict[str, float]] = {}
    if shape.experts and setup.ep > 1:  # the experts leave the blocks' units for their own, over efsdp
        stage, block = stage - blocks * shape.block_experts, block - shape.block_experts
        out.update(_experts_terms(shape, setup, blocks, c, r, rs))
    if setup.dp_shard > 1:
        backward = 0 if setup.pp > 1 else (blocks - 1) * block
        out["dp_shard"] = {"all_gather": (stage + backward) * c, rs: stage * r}
    if setup.dp_replicate > 1:
        out["dp_replicate"] = {"all_reduce": stage / setup.dp_shard * r}
    n_stages = setup.pp * setup.virtual_stages
    stages = rank_stages(setup)[pp_rank]
    act = setup.batch / setup.m * setup.seq * shape.dim * c  # one micro-batch's b s h
    if setup.tp > 1:
        last = n_stages - 1 in stages
        ends = (0 in stages) + last
        per = 4 * blocks + (2 * blocks if setup.ac == "full" else 0) + ends
        norms = (2 * blocks + last) * shape.dim * c
        tokens = setup.batch / setup.m * setup.seq  # of one micro-batch
        loss = 3 * tokens * 4 if last and setup.pp == 1 else 0
        logits = tokens * shape.vocab * c if last and setup.pp > 1 else 0
        out["tp"] = {"all_gather": (per * act + logits) * setup.m, rs: per * act * setup.m}
        if rs == "all_reduce":  # gloo: the reduce-scatters are all-reduces too
            out["tp"]["all_reduce"] += norms + loss * setup.m
        else:
            out["tp"]["all_reduce"] = norms + loss * setup.m
    if shape.experts and setup.balance:
        parts = blocks * (2 * shape.experts + 1) * 4 * setup.m * (2 if setup.ac else 1)
        for dim, size in (("dp_replicate", setup.dp_replicate), ("dp_shard", setup.dp_shard), ("cp", setup.cp)):
            if size > 1:
                out.setdefault(dim, {})["all_reduce"] = out.get(dim, {}).get("all_reduce", 0.0) + parts
    if setup.pp > 1:
        boundaries = sum((st > 0) + (st < n_stages - 1) for st in stages)
        out["pp"] = {"send_recv": 2 * boundaries * act * setup.m / setup.tp}
    return out


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


class CommLedger(L.Callback):
    """Records every optimizer step's collectives (see the module docstring). ``log``: send them to the loggers on
    logging steps (rank 0)."""

    def __init__(self, log: bool = True) -> None:
        self.log = log
        self.steps: list[dict[str, dict[str, list[int]]]] = []
        self._last = -1  # the newest flight-recorder record already counted
        self._groups: dict[str, tuple[str, int]] = {}
        self._p2p: Any = None  # on gloo with pp > 1 (see the module docstring)
        self._p2p_active = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        entries = compat.flight_recorder_entries()
        if not entries and trainer.world_size > 1:
            raise RuntimeError(
                "CommLedger reads torch's flight recorder, which is off: use CuboidStrategy(flight_recorder=N) with "
                "N > 0 (the default, 20000), and do not set TORCH_FR_BUFFER_SIZE=0."
            )
        self._last = max((e["record_id"] for e in entries), default=-1)
        try:
            mesh = trainer.strategy.device_mesh
        except (AttributeError, AssertionError, RuntimeError):  # not a mesh strategy
            mesh = None
        experts = getattr(trainer.strategy, "experts_layout", None)
        self._groups = mesh_groups(mesh, experts) if mesh is not None else {}
        if mesh is not None and "pp" in (mesh.mesh_dim_names or ()) and mesh["pp"].size() > 1:
            import torch.distributed as dist

            if dist.get_backend(mesh["pp"].get_group()) == "gloo":
                self._p2p = compat.PointToPointCounter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._p2p is not None and not self._p2p_active:  # still active if the last batch end never came
            self._p2p.__enter__()
            self._p2p_active = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._exit_p2p()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._exit_p2p()

    def _exit_p2p(self) -> None:
        if self._p2p is not None and self._p2p_active:
            self._p2p.__exit__(None, None, None)
            self._p2p_active = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._exit_p2p()
        if compat.should_accumulate(trainer):
            return
        entries = [e for e in compat.flight_recorder_entries() if e["record_id"] > self._last]
        if entries:
            self._last = entries[-1]["record_id"]
        step = tally(entries, self._groups)
        if self._p2p is not None:  # gloo's send/recv, counted by the dispatch mode
            step.setdefault("pp", {})["send_recv"] = [self._p2p.count, self._p2p.bytes]
            self._p2p.count = self._p2p.bytes = 0
        self.steps.append(step)
        every = trainer.log_every_n_steps
        if self.log and trainer.is_global_zero and trainer.loggers and every and trainer.global_step % every == 0:
            metrics = {}
            for dim, kinds in step.items():
                for kind, (count, nbytes) in kinds.items():
                    metrics[f"comm/{dim}/{kind}_count"] = float(count)
                    metrics[f"comm/{dim}/{kind}_MB"] = nbytes / 1e6
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
