"""Parity: every layout trains like single-process fp32 (same seed, data, AdamW, clipping).

The bound, the same for every layout and never loosened: each step's loss within relative
1e-5 of the reference, and every element of every final parameter within 1e-5 (absolute). The
tests also check that the layout is real: DTensor placements and local shapes, per-rank bytes
of parameters + gradients + optimizer state about total / (dp_shard x tp), tensor-parallel peers
fed the same batch and data-parallel ranks disjoint ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from ahead import ahead
from harness import WORKERS, SpecRuns
from parity_lib import CLIP, reference_run

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5

COLWISE = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "tok_embeddings.weight", "output.weight")
ROWWISE = ("wo.weight", "w2.weight")


@dataclass(frozen=True)
class Run:
    """One parity run: processes, CuboidStrategy arguments, accumulate_grad_batches, meta-device init, and whether
    a CommLedger books the set-up's collectives (who received which weights)."""

    world: int
    strategy: dict
    accumulate: int = 1
    meta_init: bool = False
    ledger: bool | str = False  # "per_step": every optimizer step's collectives too


RUNS: dict[str, Run] = {}
for layout, world, kwargs in [
    ("dp2", 2, {}),
    ("tp2", 2, {"tensor_parallel": 2}),
    ("dp2xtp2", 4, {"tensor_parallel": 2}),
    ("hsdp2x2", 4, {"data_parallel_replicate": 2}),
]:
    RUNS[f"{layout}"] = Run(world, kwargs)
    RUNS[f"{layout}-ac_full"] = Run(world, {**kwargs, "activation_checkpointing": "full"})
    RUNS[f"{layout}-ac_selective"] = Run(world, {**kwargs, "activation_checkpointing": "selective"})
    RUNS[f"{layout}-accum2"] = Run(world, kwargs, accumulate=2)
RUNS["dp2xtp2-meta_init"] = Run(4, {"tensor_parallel": 2}, meta_init=True)
# HSDP with 4 batches accumulated: the all-reduce across replicas once per optimizer step (the default), and at every
# batch (defer_reductions=None, as before), each step's collectives booked by the ledger.
ACCUMULATED = {"hsdp2x2-accum4": "replicas", "hsdp2x2-accum4-every": None}
for name, mode in ACCUMULATED.items():
    RUNS[name] = Run(4, {"data_parallel_replicate": 2, "defer_reductions": mode}, accumulate=4, ledger="per_step")
RUNS["hsdp2x2-accum2-defer_all"] = Run(4, {"data_parallel_replicate": 2, "defer_reductions": "all"}, accumulate=2)
# HSDP composed with TP (replicate 2 x shard 2 x tp 2), partial resharding after forward, compiled blocks.
RUNS["hsdp2x2xtp2"] = Run(8, {"data_parallel_replicate": 2, "tensor_parallel": 2})
RUNS["dp4-reshard_after_forward2"] = Run(4, {"reshard_after_forward": 2})
RUNS["dp2-compile-ac_selective"] = Run(2, {"compile": True, "activation_checkpointing": "selective"})
# Pipeline parallel: every schedule at pp=2, then pp composed with dp and tp, and the 8-process 3D cube.
PP = {"pipeline_parallel": 2}
RUNS["pp2-1F1B"] = Run(2, PP)
RUNS["pp2-GPipe-accum2"] = Run(2, {**PP, "pipeline_schedule": "GPipe"}, accumulate=2)
RUNS["pp2-Interleaved1F1B-ac_full"] = Run(
    2, {**PP, "pipeline_schedule": "Interleaved1F1B", "activation_checkpointing": "full"}
)
RUNS["pp2-InterleavedZeroBubble"] = Run(2, {**PP, "pipeline_schedule": "InterleavedZeroBubble"})
RUNS["pp2-ZBVZeroBubble"] = Run(2, {**PP, "pipeline_schedule": "ZBVZeroBubble"})
RUNS["pp2-DualPipeV"] = Run(2, {**PP, "pipeline_schedule": "DualPipeV"})  # torch 2.13's DeepSeek-V3 schedule
# zero-bubble schedules recompute a checkpointed block twice (for its input gradients, then for its weights')
RUNS["pp2-ZBVZeroBubble-ac_selective"] = Run(
    2, {**PP, "pipeline_schedule": "ZBVZeroBubble", "activation_checkpointing": "selective"}
)
RUNS["pp2-DualPipeV-ac_full"] = Run(2, {**PP, "pipeline_schedule": "DualPipeV", "activation_checkpointing": "full"})
RUNS["pp2xdp2-1F1B-accum2"] = Run(4, PP, accumulate=2, ledger=True)
RUNS["pp2xtp2-Interleaved1F1B-meta_init"] = Run(
    4, {**PP, "tensor_parallel": 2, "pipeline_schedule": "Interleaved1F1B"}, meta_init=True, ledger=True
)
RUNS["pp2xdp2xtp2-1F1B"] = Run(8, {**PP, "tensor_parallel": 2})
RUNS["pp2xdp2xtp2-Interleaved1F1B-accum2-ac_selective"] = Run(
    8,
    {
        **PP,
        "tensor_parallel": 2,
        "pipeline_schedule": "Interleaved1F1B",
        "microbatches": 4,
        "activation_checkpointing": "selective",
    },
    accumulate=2,
)


# Cuboid's own MoE balanced by the experts' bias (expert_bias_rate) on every dimension but cp at once: pp2 x dp2 (ep2)
# x tp2 on 8 ranks, 2 batches of 4 micro-batches per optimizer step: each micro-batch counted once in the step's
# update (parity_lib.ReferenceBias on the same 8 pieces). Its clip (1.0) cuts the reference's second and third steps.
MOE_BIAS_8 = {
    "name": "cuboid_moe-bias-pp2xep2xtp2-accum2",
    "model": "cuboid_moe",
    "strategy": {**PP, "tensor_parallel": 2, "expert_parallel": 2, "expert_bias_rate": 1e-2},
    "accumulate": 2,
    "max_steps": 3,
    "clip": 1.0,
}


# Muon across shards (cuboid.optim.Muon, its Newton-Schulz in fp32, for the blocks' matrices; AdamW for the rest;
# manual optimization, two optimizer steps a batch): 6 batches against parity_lib.muon_reference_run. dp2 sharded,
# tp2, dp2 x tp2 (matrices sharded over both dims: FSDP2's strided rows and tp's columns or rows).
MUON_SPECS = {
    2: [
        {"name": "muon-dp2", "optimizer": "muon", "strategy": {"data_parallel_shard": "auto"}, "ledger": "per_step"},
        {"name": "muon-tp2", "optimizer": "muon", "strategy": {"tensor_parallel": 2}},
        # every parameter given to Muon: torch refuses the norms' 1-D weights; Cuboid names them
        {
            "name": "err-muon-on-norms",
            "optimizer": "muon_everything",
            "strategy": {"data_parallel_shard": "auto"},
            "expect_error": True,
        },
    ],
    4: [
        {"name": "muon-dp2xtp2", "optimizer": "muon", "strategy": {"tensor_parallel": 2}, "ledger": "per_step"},
        # HSDP: each replica pair gathers among its own 2 ranks (nothing crosses the replicas)
        {"name": "muon-hsdp2x2", "optimizer": "muon", "strategy": {"data_parallel_replicate": 2}, "ledger": "per_step"},
    ],
}
for _specs in MUON_SPECS.values():
    for _spec in _specs:
        _spec.update(max_steps=12, clip=None)  # 12 optimizer steps: 6 batches; the reference does not clip


# Pipelined runs that must stop before the first step, with a message that says what to change.
PIPELINE_ERRORS = [
    # 92 samples in batches of 8: the last batch holds 4, which 8 microbatches cannot split.
    {
        "name": "err-partial-last-batch",
        "expect_error": True,
        "samples": 92,
        "batch_size": 8,
        "strategy": {"pipeline_parallel": 2, "microbatches": 8},
    },
    {
        "name": "err-batch-6-microbatches-4",
        "expect_error": True,
        "batch_size": 6,
        "strategy": {"pipeline_parallel": 2, "microbatches": 4},
    },
    {
        "name": "err-step-without-model-call",
        "expect_error": True,
        "module": "no_model_call",
        "strategy": {"pipeline_parallel": 2},
    },
]


# Each rank initializes its own shards of a meta-built model (weights_init="local"): not parity (the same
# distribution, not one process's values), checked by the first values' statistics and the set-up's traffic.
LOCAL_INIT = {
    f"local_init-{layout}": {
        "name": f"local_init-{layout}",
        "strategy": {**strategy, "weights_init": "local"},
        "meta_init": True,
        "ledger": True,
        "init_stats": True,
        "max_steps": 2,
    }
    for layout, strategy in (("dp2xtp2", {"tensor_parallel": 2}), ("pp2xdp2", {"pipeline_parallel": 2}))
}


# layout -> (max relative loss error, max abs parameter error); printed at the end of the run.
PARITY_TABLE: dict[str, tuple[float, float]] = {}


@pytest.fixture(scope="module")
@ahead
def results(tmp_path_factory: pytest.TempPathFactory) -> SpecRuns:
    runs = SpecRuns(tmp_path_factory.mktemp("parity"))
    for world in sorted({run.world for run in RUNS.values()}):
        specs = [
            {
                "name": name,
                "strategy": run.strategy,
                "accumulate": run.accumulate,
                "meta_init": run.meta_init,
                "ledger": run.ledger,
            }
            for name, run in RUNS.items()
            if run.world == world
        ]
        if world == 2:
            specs += PIPELINE_ERRORS
        if world == 4:
            specs += list(LOCAL_INIT.values())
        if world == 8:
            specs.append(MOE_BIAS_8)
        specs += MUON_SPECS.get(world, [])
        runs.launch(world, WORKERS / "parity_worker.py", specs)
    return runs


@pytest.fixture(scope="module")
def references() -> dict[int, object]:
    return {acc: reference_run(acc) for acc in (1, 2, 4)}


def test_reference_clips_on_some_steps_only(references) -> None:
    for acc, ref in references.items():
        clipped = [n > CLIP[acc] for n in ref.grad_norms]
        assert any(clipped) and not all(clipped), (acc, ref.grad_norms)
        assert len(ref.grad_norms) >= 12 // acc and len(ref.losses) >= 12


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_loss_and_parameters_match_single_process(name: str, results, references) -> None:
    got, ref = results[name], references[RUNS[name].accumulate]
    assert len(got["losses"]) == len(ref.losses) >= 12
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref.losses, strict=True)]
    assert max(rel) <= LOSS_RTOL, f"{name}: per-step relative loss error {max(rel):.2e}"
    err = {k: (got["params"][f"model.{k}"] - v).abs().max().item() for k, v in ref.params.items()}
    worst = max(err, key=err.get)
    PARITY_TABLE[name] = (max(rel), err[worst])
    assert err[worst] <= PARAM_ATOL, f"{name}: {worst} max abs error {err[worst]:.2e}"
    assert abs(got["grad_norm"] - ref.grad_norms[-1]) <= LOSS_RTOL * ref.grad_norms[-1]
    if "tensor_parallel" in RUNS[name].strategy:  # loss parallel is on, under pp too: logits never gathered over tp
        assert all(r["loss_parallel"] for r in got["ranks"]), name


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, run in RUNS.items() if run.ledger is True])
def test_a_pipelined_build_sends_each_stage_its_own_weights_and_no_other(name: str, results) -> None:
    """Rank 0's weights (its init of a meta-built model, or its values of one built for real) reach only the ranks
    of the stage that keeps them: the ledger's set-up table shows, on every rank, broadcasts over its own stage's
    group carrying exactly the full bytes of the tensors it holds, rank 0 alone in the other stage's group as the
    sender, and no weight anywhere else (the world's broadcasts are the run's flags and names, under 1 KiB). Before,
    every tensor went to the whole world."""
    built = "initialized" if RUNS[name].meta_init else "sent"
    for facts in results[name]["ranks"]:
        table, stage = facts["setup_comm"], facts["pp_rank"]
        assert facts["ledger_steps"] == 0, facts["ledger_steps"]  # CommLedger(per_step=False): the set-up only
        groups = {dim: kinds for dim, kinds in table.items() if dim.startswith("cuboid_weights_stage")}
        own = f"cuboid_weights_stage{stage}"
        assert set(groups) == ({own, "cuboid_weights_stage1"} if facts["rank"] == 0 else {own}), (facts["rank"], table)
        assert groups[own]["broadcast"][1] == facts["held_bytes"], (facts["rank"], groups, facts["held_bytes"])
        elsewhere = sum(kinds.get("broadcast", [0, 0])[1] for dim, kinds in table.items() if dim not in groups)
        assert elsewhere < 1024, (facts["rank"], table)
        if facts["rank"] == 0:
            assert facts["weights_made"][built] > 0, facts["weights_made"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOCAL_INIT))
def test_local_init_makes_each_ranks_shards_itself_with_the_models_distribution(name: str, results) -> None:
    """weights_init="local": every rank runs the model's init on its own shards (counted), no weight is sent (the
    set-up's broadcasts carry flags and names only), and the first values follow the model's init: norms ones,
    the residual projections N(0, 0.02 / sqrt(2 x 4 layers)), the rest N(0, 0.02); the first loss is a uniform
    guess's, ln 256. (On CPU DTensor has no random tracker: each shard draws the same numbers. The statistics hold
    either way; on a GPU the shards differ.)"""
    got = results[name]
    for facts in got["ranks"]:
        assert facts["weights_made"]["initialized"] > 0, facts["weights_made"]
        table = facts["setup_comm"]
        assert not any(dim.startswith("cuboid_weights") for dim in table), table
        assert sum(kinds.get("broadcast", [0, 0])[1] for kinds in table.values()) < 1024, table
        for pname, (mean, std, n) in facts["init_stats"].items():
            if pname.endswith("norm.weight"):
                assert (mean, std) == (1.0, 0.0), pname
                continue
            want = 0.02 / (2 * 4) ** 0.5 if pname.endswith(("wo.weight", "w2.weight")) else 0.02
            # within 5 standard errors of n draws (n: one shard's elements, as on CPU every shard repeats them)
            assert abs(mean) < 5 * want / n**0.5 and abs(std - want) < 5 * want / (2 * n) ** 0.5, (pname, mean, std, n)
    assert abs(got["losses"][0] - math.log(256)) < 0.05, got["losses"][0]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if "-" not in n and not n.startswith("pp")])
def test_layout_is_real(name: str, results) -> None:
    world, kwargs = RUNS[name].world, RUNS[name].strategy
    tp, rep = kwargs.get("tensor_parallel", 1), kwargs.get("data_parallel_replicate", 1)
    shard = world // (tp * rep)
    ranks = results[name]["ranks"]
    for facts in ranks:
        for pname, (dims, placements, local, full) in facts["placements"].items():
            is_tp = tp > 1 and pname.endswith(COLWISE + ROWWISE)
            is_norm = tp > 1 and pname.endswith("norm.weight")  # sequence parallel: replicated over tp
            expected_dims = ("dp_replicate", "dp_shard") if rep > 1 else ("dp_shard",)
            assert tuple(dims) == expected_dims + (("tp",) if is_tp or is_norm else ()), (pname, dims)
            if is_norm:
                assert placements[-1] == "R", (pname, placements)
            if rep > 1:
                assert placements[0] == "R", (pname, placements)
            if is_tp:
                assert placements[-1] == ("S(0)" if pname.endswith(COLWISE) else "S(1)"), (pname, placements)
            divisor = shard * (tp if is_tp else 1)
            assert abs(torch.Size(local).numel() * divisor - torch.Size(full).numel()) <= divisor * full[-1], pname
        assert len(facts["placements"]) == 39  # every parameter of the model is a DTensor
    # Per-rank persistent bytes: fp32 params + grads + AdamW (exp_avg, exp_avg_sq) = 16 B/param / (shard x tp).
    total = sum(torch.Size(f).numel() for *_, f in ranks[0]["placements"].values())
    ideal = 16 * total / (shard * tp)
    for facts in ranks:
        got = sum(facts["bytes"].values())
        assert 0.97 * ideal <= got <= 1.05 * ideal, (facts["rank"], got, ideal)
    # Data: tp peers (same dp index) see the same samples; different dp indices see disjoint ones.
    by_dp: dict[int, list] = {}
    for facts in ranks:
        by_dp.setdefault(facts["dp_rank"], []).append(facts["seen"])
    assert len(by_dp) == shard * rep
    for seen in by_dp.values():
        assert all(s == seen[0] for s in seen)
    flat = [set(sum(seen[0], [])) for seen in by_dp.values()]
    assert sum(len(s) for s in flat) == len(set().union(*flat)) == 96
    for facts in ranks:
        assert facts["dp_sum"] == shard * rep  # reduce(sum) over the dp group counts each dp rank once


@pytest.mark.slow
def test_compile_really_compiles(results) -> None:
    """compile=True runs the blocks through torch.compile (one Dynamo graph, shared by every block and step: no
    recompilation), the plain run does not."""
    assert all(r["compiled_graphs"] == 1 for r in results["dp2-compile-ac_selective"]["ranks"])
    assert all(r["compiled_graphs"] == 0 for r in results["dp2"]["ranks"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2", "dp2xtp2", "hsdp2x2"])
def test_activation_checkpointing_is_real(layout: str, results) -> None:
    """Backward re-runs forward ops under AC: full recomputes the matmuls too, selective only the cheap ops."""
    ops = {ac: results[f"{layout}{ac}"]["ranks"][0]["backward_ops"] for ac in ("", "-ac_selective", "-ac_full")}
    assert ops[""]["total"] < ops["-ac_selective"]["total"] < ops["-ac_full"]["total"], ops
    assert ops[""]["mm"] == ops["-ac_selective"]["mm"] < ops["-ac_full"]["mm"], ops
    if "tp" in layout:  # selective keeps the tensor-parallel collectives' outputs; full runs them again
        tp = {ac: ops[ac]["tp_collectives"] for ac in ops}
        assert 0 < tp[""] == tp["-ac_selective"] < tp["-ac_full"], ops


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("pp")])
def test_pipeline_is_real(name: str, results) -> None:
    """Each rank holds only its stages' blocks; the schedule is the one asked for; every rank logs the same loss."""
    kwargs = RUNS[name].strategy
    schedule = kwargs.get("pipeline_schedule", "1F1B")
    ranks = results[name]["ranks"]
    v_shaped = schedule in ("ZBVZeroBubble", "DualPipeV")
    n_stages = 4 if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") or v_shaped else 2
    per_stage = 4 // n_stages
    mesh = torch.tensor(results[name]["mesh"])  # (pp, dp_replicate, dp_shard, tp) -> global rank
    for facts in ranks:
        assert facts["schedule"] == f"Schedule{schedule}"
        pp_rank = int((mesh == facts["rank"]).nonzero()[0, 0])
        stages = [pp_rank, 2 * 2 - 1 - pp_rank] if v_shaped else list(range(pp_rank, n_stages, 2))
        blocks = {str(b) for s in stages for b in range(s * per_stage, (s + 1) * per_stage)}
        held = {p.split(".")[2] for p in facts["params"] if p.startswith("model.layers.")}
        assert held == blocks, (facts["rank"], held, blocks)
        assert ("model.tok_embeddings.weight" in facts["params"]) == (0 in stages)
        assert ("model.output.weight" in facts["params"]) == (n_stages - 1 in stages)
        assert facts["logged"] == ranks[0]["logged"]  # rank 0 (stage 0) logs the same loss as the last stage
    assert results[name]["losses"] == pytest.approx(ranks[0]["logged"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "err-partial-last-batch",
            "last batch of each epoch holds 4 samples (92 per rank, batch size 8), not divisible by microbatches=8",
        ),
        ("err-batch-6-microbatches-4", "batch size 6 is not divisible by microbatches=4"),
        ("err-step-without-model-call", "training_step never calls self.model(...)"),
    ],
)
def test_pipeline_refuses_what_it_cannot_split(name: str, message: str, results) -> None:
    assert results[name]["error"] is not None and message in results[name]["error"], results[name]


# The layout planner's persistent bytes per rank (cuboid.planning.estimate, by formula) beside the ones measured from each
# rank's DTensor local shapes and optimizer state in the runs above; printed at the end.
PLANNER_TABLE: dict[str, tuple[float, float]] = {}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_planner_persistent_bytes_are_within_10_percent_of_measured(name: str, results) -> None:
    """Parameters + gradients + AdamW state, fp32, every rank of every layout (pp, HSDP, TP and 3D included)."""
    from parity_lib import CFG

    from cuboid.pipeline.stages import MULTI_STAGE
    from cuboid.planning.estimate import Setup, Shape, rank_memory

    run, ranks = RUNS[name], results[name]["ranks"]
    kw = run.strategy
    pp, rep, tp = kw.get("pipeline_parallel", 1), kw.get("data_parallel_replicate", 1), kw.get("tensor_parallel", 1)
    schedule = kw.get("pipeline_schedule", "1F1B")
    setup = Setup(pp=pp, dp_replicate=rep, dp_shard=run.world // (pp * rep * tp), tp=tp, precision="32-true",
                  schedule=schedule, virtual_stages=2 if pp > 1 and schedule in MULTI_STAGE else 1)  # fmt: skip
    worst = 0.0
    for facts in ranks:
        pp_rank = facts["rank"] // (run.world // pp)
        predicted = rank_memory(Shape.of(CFG), setup, pp_rank).persistent
        measured = sum(facts["bytes"].values())
        worst = max(worst, abs(predicted / measured - 1))
        assert abs(predicted / measured - 1) <= 0.10, (facts["rank"], predicted, measured)
    PLANNER_TABLE[name] = (worst, sum(sum(f["bytes"].values()) for f in ranks) / len(ranks))


# cuboid.measure's parameter bytes per rank, estimated from the unsharded module before any sharding (what setup refuses
# a layout on, on GPUs), beside each rank's measured DTensor local parameter bytes; printed at the end.
FIT_TABLE: dict[str, float] = {}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_fit_estimate_before_sharding_is_within_10_percent_of_measured(name: str, results) -> None:
    from parity_lib import fit_estimate_error

    FIT_TABLE[name] = fit_estimate_error(results[name]["ranks"])
    assert FIT_TABLE[name] <= 0.10, FIT_TABLE[name]


@pytest.mark.slow
def test_hsdp_accumulation_all_reduces_across_replicas_once_per_optimizer_step(results) -> None:
    """accumulate_grad_batches=4 under HSDP 2 x 2: by default (``defer_reductions="replicas"``) each unit's
    gradients are reduce-scattered at every batch and all-reduced across the replicas once per optimizer step, a
    quarter of the all-reduces of reducing at every batch (``None``, as before); the reduce-scatters stay; the
    losses and weights equal (both match one process: test_loss_and_parameters_match_single_process)."""
    deferred, every = results["hsdp2x2-accum4"], results["hsdp2x2-accum4-every"]
    for mine, theirs in zip(deferred["ranks"], every["ranks"], strict=True):
        steps, before = mine["ledger_tables"], theirs["ledger_tables"]
        assert len(steps) == len(before) == 3
        for step, old in zip(steps, before, strict=True):
            (count, nbytes), (count_before, nbytes_before) = (
                step["dp_replicate"]["all_reduce"],
                old["dp_replicate"]["all_reduce"],
            )
            assert count >= 1 and count * 4 == count_before and nbytes * 4 == nbytes_before, (step, old)
            assert step["dp_shard"] == old["dp_shard"], (step, old)  # the reduce-scatters and all-gathers stay
    print(f"HSDP 2 x 2, accumulate 4: {count} all-reduces across replicas per step ({count_before} at every batch)")
    diff = max(abs(a - b) for a, b in zip(deferred["losses"], every["losses"], strict=True))
    assert diff <= LOSS_RTOL * max(abs(b) for b in every["losses"]), diff


@pytest.mark.slow
def test_the_experts_bias_on_pp_ep_tp_with_accumulation_equals_one_process(results) -> None:
    """``expert_bias_rate`` at pp2 x dp2 (ep2) x tp2, two batches per optimizer step: the losses, the weights and
    every router's bias (each stage's) equal one process that counts every micro-batch of the step once."""
    from parity_lib import MOE_CFG, PARAM_ATOL, parity_errors

    spec = MOE_BIAS_8
    ref = reference_run(accumulate=2, clip=spec["clip"], steps=6, cfg=MOE_CFG, microbatches=4, expert_bias=1e-2)
    clipped = [n > spec["clip"] for n in ref.grad_norms]
    assert any(clipped) and not all(clipped), ref.grad_norms
    got = results[spec["name"]]
    rel, err = parity_errors(got, ref)
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)
    assert sorted(got["biases"]) == sorted(ref.biases) and any(b.abs().max() > 0 for b in ref.biases.values())
    worst = max((got["biases"][k] - v).abs().max().item() for k, v in ref.biases.items())
    assert worst <= PARAM_ATOL, worst


MUON_RUNS = [s["name"] for specs in MUON_SPECS.values() for s in specs if not s.get("expect_error")]


@pytest.mark.slow
@pytest.mark.parametrize("name", MUON_RUNS)
def test_muon_across_shards_equals_one_process(name: str, results) -> None:
    """``cuboid.optim.Muon`` (fp32 Newton-Schulz) on matrices sharded by FSDP2, tensor parallel or both: every
    step's loss and the final weights equal one process's, whose Muon is written out (parity_lib)."""
    from parity_lib import PARAM_ATOL, muon_reference_run, parity_errors

    rel, err = parity_errors(results[name], muon_reference_run(6))
    PARITY_TABLE[name] = (rel, err)
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (name, rel, err)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "dim", "ranks"),
    [("muon-dp2", "dp_shard", 2), ("muon-dp2xtp2", "muon_dp_shard_tp", 4), ("muon-hsdp2x2", "dp_shard", 2)],
)
def test_muon_moves_each_sharded_matrix_with_one_gather_and_one_scatter(name: str, dim: str, ranks: int, results):
    """The communication ledger of every step after the first (which also learns where each rank's elements sit):
    one gather and one scatter per sharded matrix Muon steps, each of ``n x P x 4`` bytes (``n`` the ranks the
    matrix is split over, ``P`` its largest shard's elements, fp32), on those ranks' group alone: under HSDP the
    replicas' dim carries none of it."""
    from parity_lib import initial_model, muon_names

    matrices = [f"model.{n}" for n in muon_names(initial_model())]
    got = results[name]
    placements = [facts["placements"] for facts in got["ranks"]]
    expected = sum(ranks * max(math.prod(p[n][2]) for p in placements) * 4 for n in matrices)
    for facts in got["ranks"]:
        tables = facts["ledger_tables"]
        assert len(tables) == 6
        for table in tables[1:]:
            assert table[dim]["gather"] == [len(matrices), expected], (facts["rank"], table[dim])
            assert table[dim]["scatter"] == [len(matrices), expected], (facts["rank"], table[dim])
            others = [d for d, kinds in table.items() if d != dim and {"gather", "scatter"} & set(kinds)]
            assert not others, (facts["rank"], others)


@pytest.mark.slow
def test_muon_on_a_parameter_that_is_not_a_matrix_is_refused_by_name(results) -> None:
    """Every parameter handed to torch's Muon: torch refuses a 1-D one by its size alone; setup's refusal names the
    parameters of that size and what to give Muon instead."""
    error = results["err-muon-on-norms"]["error"]
    assert error is not None and error.startswith("MuonError: Muon steps matrices only"), error
    assert "model.layers.0.attention_norm.weight" in error and "AdamW" in error, error
