"""Expert parallel trains like one process: transformers Qwen3-MoE and Mixtral (4 experts, top-2, the
load-balancing loss in ``.loss``, clipping on some steps) and MiniCPM5-MoE (at ep2 x tp2, its own plan) at ep2 (dp_shard=2, each rank holding 2 experts), Qwen3-MoE
at ep2 inside dp_shard=4 (the experts' FSDP over the 2 ranks holding the same experts) and ep2 x HSDP2, with tp, pp
and cp beside. The LightningModule is the suite's usual ``third_party.HFModule``, unchanged. Checkpoints move between
ep2 and ep1 both ways. The one parity bound (1e-5).

The single-process reference runs the global batch (``third_party.reference_run``): Cuboid sums the load-balancing
statistic over the ranks (``load_balancing="global"``). Under pp it is each microbatch's: the reference runs the
ranks' ``m``-th microbatches together. The ``-local`` run keeps each rank's own, against the mean of the ranks' own
losses.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import parity_lib
import pytest
import third_party
import torch
from harness import ROOT, WORKERS, SpecRuns, run_checked
from parity_lib import GLOBAL_BATCH, LOSS_RTOL, PARAM_ATOL, SEQ, parity_errors

STEPS = 6  # of the epoch's 12
LOG_EVERY = 2  # CuboidMonitor logs (and counts expert load) on steps 0, 2 and 4
EP2 = {"expert_parallel": 2}
CP_SEQ = 63  # a transformers model reads seq + 1 = 64 tokens: a multiple of 2 x cp
RATE = 1e-2  # expert_bias_rate: a bias of about 0.015 after 6 steps, which moves the losses by about 1e-4
BIAS = {"expert_bias_rate": RATE}
RUNS: dict[str, tuple[int, dict]] = {
    "hf_qwen3_moe-ep2": (2, {"model": "hf_qwen3_moe", "strategy": EP2}),
    # each rank's own statistic, as DDP computes it (the default sums it over the ranks: "global")
    "hf_qwen3_moe-ep2-local": (2, {"model": "hf_qwen3_moe", "strategy": {**EP2, "load_balancing": "local"}}),
    "hf_mixtral-ep2": (2, {"model": "hf_mixtral", "strategy": EP2}),
    "hf_qwen3_moe-ep2-in-dp_shard4": (4, {"model": "hf_qwen3_moe", "strategy": EP2}),
    "hf_mixtral-ep2-in-dp_shard4": (4, {"model": "hf_mixtral", "strategy": EP2}),
    "hf_qwen3_moe-ep2xhsdp2": (4, {"model": "hf_qwen3_moe", "strategy": {**EP2, "data_parallel_replicate": 2}}),
    # the model's own tp plan without its expert entries: experts whole on each tp rank (split over ep when asked)
    "hf_qwen3_moe-tp2": (2, {"model": "hf_qwen3_moe", "strategy": {"tensor_parallel": 2}}),
    "hf_mixtral-ep2xtp2": (4, {"model": "hf_mixtral", "strategy": {**EP2, "tensor_parallel": 2}}),
    "hf_qwen3_moe-ep2xtp2": (4, {"model": "hf_qwen3_moe", "strategy": {**EP2, "tensor_parallel": 2}}),
    # a family no other test names (transformers 5.25): its own plan's unit_colwise k/v, gated attention, a dense
    # first layer, shared experts beside the routed ones, sigmoid routing and no load-balancing loss
    "hf_minicpm5_moe-ep2xtp2": (4, {"model": "hf_minicpm5_moe", "strategy": {**EP2, "tensor_parallel": 2}}),
    # under pp the router logits travel with the hidden states; the load-balancing loss is each microbatch's own
    "hf_qwen3_moe-pp2xep2": (4, {"model": "hf_qwen3_moe", "strategy": {**EP2, "pipeline_parallel": 2}}),
    "hf_mixtral-pp2xep2": (4, {"model": "hf_mixtral", "strategy": {**EP2, "pipeline_parallel": 2}}),
    # under cp the load-balancing statistic is summed over the sequence's ranks (padding left out, as the model does)
    "hf_qwen3_moe-ep2xcp2-padded": (2, {"model": "hf_qwen3_moe", "strategy": {**EP2, "context_parallel": 2},
                                        "seq": CP_SEQ, "padded": True}),
    "hf_mixtral-pp2xcp2xep2": (4, {"model": "hf_mixtral", "strategy": {**EP2, "context_parallel": 2,
                                                                       "pipeline_parallel": 2}, "seq": CP_SEQ}),
    # Cuboid's own MoE (parity_lib.MOE_CFG): each block's load-balancing loss from its parts summed over the ranks
    "cuboid_moe-ep2": (2, {"model": "cuboid_moe", "strategy": EP2}),
    "cuboid_moe-ep2-in-dp_shard4": (4, {"model": "cuboid_moe", "strategy": EP2}),
    "cuboid_moe-ep2xtp2": (4, {"model": "cuboid_moe", "strategy": {**EP2, "tensor_parallel": 2}}),
    "cuboid_moe-pp2xep2": (4, {"model": "cuboid_moe", "strategy": {**EP2, "pipeline_parallel": 2}}),
    "cuboid_moe-pp2xcp2xep2": (4, {"model": "cuboid_moe", "strategy": {**EP2, "context_parallel": 2,
                                                                       "pipeline_parallel": 2}, "seq": 64}),
    # activation checkpointing: the recompute takes each layer's split sizes from its forward (no second host read
    # or count exchange), and under pp (backward inside the step) the blocks' statistics are summed once per stage
    "hf_qwen3_moe-ep2-ac_selective": (2, {"model": "hf_qwen3_moe",
                                          "strategy": {**EP2, "activation_checkpointing": "selective"}}),
    "cuboid_moe-pp2xep2-ac_full": (4, {"model": "cuboid_moe", "strategy": {**EP2, "pipeline_parallel": 2,
                                                                           "activation_checkpointing": "full"}}),
    # pp x tp: the last stage's shape inference sums loss parallel's sharded logits beside the plain aux loss (a
    # mixed DTensor and Tensor in its backward before the zero loss took the logits' local shard)
    "cuboid_moe-pp2xtp2": (4, {"model": "cuboid_moe", "strategy": {"pipeline_parallel": 2, "tensor_parallel": 2}}),
    # balancing without an auxiliary loss (expert_bias_rate): each router's bias, moved after every optimizer step
    # from the tokens its experts got over the step's ranks, equals one process's (parity_lib.ReferenceBias); under
    # pp the schedule's shape inference counts nothing, nor does a checkpointed block's recompute
    "cuboid_moe-bias-dp2": (2, {"model": "cuboid_moe", "strategy": BIAS}),
    "cuboid_moe-bias-tp2": (2, {"model": "cuboid_moe", "strategy": {**BIAS, "tensor_parallel": 2}}),
    "cuboid_moe-bias-cp2": (2, {"model": "cuboid_moe", "strategy": {**BIAS, "context_parallel": 2}, "seq": 64}),
    "cuboid_moe-bias-pp2-ac_full": (2, {"model": "cuboid_moe", "strategy": {**BIAS, "pipeline_parallel": 2,
                                                                            "activation_checkpointing": "full"}}),
    "hf_qwen3_moe-bias-ep2": (2, {"model": "hf_qwen3_moe", "strategy": {**BIAS, **EP2}}),
    # DeepSeek-V3's router keeps its own selection bias (e_score_correction_bias): Cuboid moves that one
    "hf_deepseek_v3-bias-dp2": (2, {"model": "hf_deepseek_v3", "strategy": BIAS}),
    "cuboid_moe-bias-pp2xep2": (4, {"model": "cuboid_moe", "strategy": {**BIAS, **EP2, "pipeline_parallel": 2}}),
    "cuboid_moe-bias-pp2xcp2xep2": (4, {"model": "cuboid_moe", "strategy": {**BIAS, **EP2, "context_parallel": 2,
                                                                            "pipeline_parallel": 2}, "seq": 64}),
    "hf_mixtral-bias-ep2xtp2": (4, {"model": "hf_mixtral", "strategy": {**BIAS, **EP2, "tensor_parallel": 2}}),
}  # fmt: skip
CLIP_CUBOID_MOE = {SEQ: 1.4, 64: 1.33}  # the reference clips on some steps and not on others


def bias_error(got: dict, ref: third_party.Reference) -> float:
    """The largest difference between a run's expert biases and the reference's, after checking that every router
    of the reference has one in the run and that the reference's moved (they start at zero; a layer's may be back at
    zero after an even number of steps, the sign rule overshooting and returning)."""
    assert ref.biases and sorted(got["biases"]) == sorted(ref.biases), (sorted(got["biases"]), sorted(ref.biases))
    assert any(b.abs().max() > 0 for b in ref.biases.values())
    return max((got["biases"][k] - v).abs().max().item() for k, v in ref.biases.items())


def dp_of(name: str) -> int:
    """The data-parallel ranks of a run (tp and cp peers and pipeline stages read the same batch)."""
    world, spec = RUNS[name]
    return world // math.prod(spec["strategy"].get(f"{d}_parallel", 1) for d in ("tensor", "pipeline", "context"))


def clip_of(name: str) -> float:
    spec = RUNS[name][1]
    if spec["model"] == "cuboid_moe":
        return CLIP_CUBOID_MOE[spec.get("seq", SEQ)]
    return third_party.clip(spec["model"], spec.get("padded", False))


def reference(name: str) -> third_party.Reference:
    """The single-process run that ``name`` must match: the same batches, as many data-parallel shares, and under
    pp the pipeline's default microbatches (2 per stage), each with its own load-balancing loss."""
    spec = RUNS[name][1]
    pp, padded = spec["strategy"].get("pipeline_parallel", 1), spec.get("padded", False)
    if spec["model"] == "cuboid_moe":
        return parity_lib.reference_run(
            clip=clip_of(name), steps=STEPS, seq=spec.get("seq", SEQ), cfg=parity_lib.MOE_CFG,
            microbatches=2 * pp if pp > 1 else 1, expert_bias=spec["strategy"].get("expert_bias_rate"),
        )  # fmt: skip
    return third_party.reference_run(
        spec["model"], dp=dp_of(name), steps=STEPS, max_norm=third_party.clip(spec["model"], padded),
        microbatches=2 * pp if pp > 1 else 1, seq=spec.get("seq", SEQ), padded=padded,
        local_balance=spec["strategy"].get("load_balancing") == "local",
        expert_bias=spec["strategy"].get("expert_bias_rate"),
    )  # fmt: skip


QWEN = {"model": "hf_qwen3_moe", "clip": third_party.clip("hf_qwen3_moe")}
SAVE = {**QWEN, "max_steps": 7, "save_every": 6}
TABLE: dict[str, tuple[float, float]] = {}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE saved by transformers (``save_pretrained``) from other weights than every run starts from."""
    path = tmp_path_factory.mktemp("qwen3_moe_pretrained")
    torch.manual_seed(1234)
    third_party.build_model("hf_qwen3_moe").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> Iterator[dict[str, dict]]:
    out = tmp_path_factory.mktemp("ep")
    got = SpecRuns(out)
    ckpt = [
        {"name": "ep2-save", "strategy": EP2, **SAVE, "save_dir": str(out / "ep2")},
        {"name": "dp2-from-ep2", "strategy": {}, **QWEN, "resume_from": str(out / "ep2" / "step=6.ckpt")},
        {"name": "dp2-save", "strategy": {}, **SAVE, "save_dir": str(out / "dp2")},
        {"name": "ep2-from-dp2", "strategy": EP2, **QWEN, "resume_from": str(out / "dp2" / "step=6.ckpt")},
        # the experts' bias in the checkpoint: saved at ep2, resumed at tp2 (whole on every rank, in the model state)
        {"name": "bias-ep2-save", "strategy": {**EP2, **BIAS}, **SAVE, "save_dir": str(out / "bias-ep2")},
        {
            "name": "bias-tp2-from-ep2",
            "strategy": {"tensor_parallel": 2, **BIAS},
            **QWEN,
            "resume_from": str(out / "bias-ep2" / "step=6.ckpt"),
        },
        # built on meta, each rank's experts filled from the safetensors file
        {
            "name": "ep2-pretrained",
            "strategy": {**EP2, "pretrained": {"model": str(pretrained)}},
            "meta_init": True,
            **QWEN,
            "max_steps": STEPS,
        },
    ]
    for world in (2, 4):
        specs = [
            {
                "name": name,
                "max_steps": STEPS,
                "clip": clip_of(name),
                "log_every": LOG_EVERY,
                **spec,
            }  # fmt: skip
            for name, (w, spec) in RUNS.items()
            if w == world
        ]
        got.launch(world, WORKERS / "parity_worker.py", specs + (ckpt if world == 2 else []))
    got["ep2-checkpoint"] = out / "ep2" / "step=6.ckpt"
    yield got
    print("\nexpert parallel parity (max relative loss error, max absolute parameter error):")
    for name, (rel, err) in TABLE.items():
        print(f"  {name:30s} {rel:.1e} {err:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_expert_parallel_matches_single_process(name: str, results) -> None:
    world, spec = RUNS[name]
    limit = clip_of(name)
    ref = reference(name)
    clipped = [n > limit for n in ref.grad_norms]
    assert any(clipped) and not all(clipped), (name, ref.grad_norms)  # clipping is exercised, both ways
    got = results[name]
    assert len(got["losses"]) == STEPS
    rel, err = parity_errors(got, ref)
    TABLE[name] = (rel, err)
    assert rel <= LOSS_RTOL, f"{name}: relative loss error {rel:.2e}"
    assert err <= PARAM_ATOL, f"{name}: parameter error {err:.2e}"
    if "expert_bias_rate" in spec["strategy"]:  # every router's bias, each stage's under pp, as one process's
        assert bias_error(got, ref) <= PARAM_ATOL, f"{name}: bias error {bias_error(got, ref):.2e}"
    # the aten ops Cuboid calls (grouped GEMMs, cp's attention blocks) were held to their CUDA kernels' preconditions
    assert (
        all(facts["cuda_contracts"] is not None for facts in got["ranks"]) or "expert_parallel" not in spec["strategy"]
    )
    # The experts are split over ep: each rank holds 2 of the 4 experts of every layer (then FSDP over efsdp);
    # under tp they are not split over tp.
    for facts in got["ranks"]:
        experts = {k: v for k, v in facts["placements"].items() if k.endswith(("gate_up_proj", "down_proj"))}
        split = "expert_parallel" in spec["strategy"]
        assert experts and all(("ep" in dims) == split and "tp" not in dims for dims, *_ in experts.values()), experts
        if spec["model"] == "hf_minicpm5_moe":  # its plan's unit_colwise k and v projections: split over tp
            kv = {
                k: dims
                for k, (dims, *_) in facts["placements"].items()
                if k.endswith(("k_proj.weight", "v_proj.weight"))
            }
            assert len(kv) == 8 and all("tp" in dims for dims in kv.values()), kv


@pytest.mark.slow
@pytest.mark.parametrize(("name", "saved"), [("dp2-from-ep2", "ep2-save"), ("ep2-from-dp2", "dp2-save")])
def test_checkpoints_move_between_ep2_and_ep1(name: str, saved: str, results) -> None:
    """A checkpoint saved at ep2 (each rank its experts) resumes at ep1 (plain FSDP) and the reverse: the resumed
    steps equal the uninterrupted reference's."""
    from cuboid.checkpoint.export import _read_meta

    ref = third_party.reference_run("hf_qwen3_moe", dp=2, max_norm=QWEN["clip"])
    assert parity_errors(results[saved], ref, slice(0, 7))[0] <= LOSS_RTOL
    rel, err = parity_errors(results[name], ref, slice(6, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (name, rel, err)
    # the layout the checkpoint records: every degree, ep included
    meta = _read_meta(results.out / saved.removesuffix("-save") / "step=6.ckpt")
    ep = 2 if saved == "ep2-save" else 1
    assert meta["cuboid"]["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": ep}


@pytest.mark.slow
def test_the_experts_bias_is_saved_and_resumed_at_another_layout(results) -> None:
    """``expert_bias_rate`` at ep2, saved at step 6, resumed at tp2: the resumed steps and the final biases equal the
    uninterrupted single-process run's (a bias restarted at zero moves the losses by about 1e-4)."""
    ref = third_party.reference_run("hf_qwen3_moe", dp=2, max_norm=QWEN["clip"], expert_bias=RATE)
    assert parity_errors(results["bias-ep2-save"], ref, slice(0, 7))[0] <= LOSS_RTOL
    rel, err = parity_errors(results["bias-tp2-from-ep2"], ref, slice(6, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)
    assert bias_error(results["bias-tp2-from-ep2"], ref) <= PARAM_ATOL


@pytest.mark.slow
def test_the_main_job_trains_cuboids_own_moe_at_ep2_as_at_ep1(tmp_path: Path) -> None:
    """``python scripts/train.py model=moe_debug strategy.expert_parallel=2 strategy.tensor_parallel=2
    trainer.devices=4``: Cuboid's Llama with 4 experts per block (top-2, a shared expert, the load-balancing loss in
    the training loss), each of the 2 data-parallel ranks' tp pairs holding 2 experts (the MoE feed-forwards whole
    on each tp rank, between sequence-parallel norms), trains step for step as the same job on 2 processes with
    every expert on every rank (FSDP only). So does pp2 x ep2, its load-balancing loss summed over the two stages'
    blocks along the pipeline: with one microbatch (GPipe) it is the whole batch's, as at pp1. (ep2 alone: the
    transformers families above.)"""
    common = [f"data.cache_dir={tmp_path / 'cache'}", "data.max_bytes=300000", "data.seq_len=64", "data.batch_size=4",
              "model=moe_debug", "trainer.max_steps=6", "trainer.val_check_interval=6", "trainer.log_every_n_steps=1",
              "trainer.enable_progress_bar=false", "logger=none"]  # fmt: skip
    runs = {}
    for name, extra in {"ep1": ["strategy.expert_parallel=1"],
                        "ep2xtp2": ["strategy.expert_parallel=2", "strategy.tensor_parallel=2", "trainer.devices=4"],
                        "pp2xep2": ["strategy.expert_parallel=2", "strategy.pipeline_parallel=2", "trainer.devices=4",
                                    "strategy.pipeline_schedule=GPipe", "strategy.microbatches=1"]}.items():  # fmt: skip
        run = tmp_path / name
        cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), *common, *extra]
        run_checked([*cmd, f"hydra.run.dir={run}"], timeout=300, cwd=tmp_path)
        runs[name] = json.loads((run / "summary.json").read_text())
    assert runs["ep1"]["layout"]["ep"] == 1 and runs["ep1"]["world_size"] == 2
    assert (runs["ep2xtp2"]["layout"]["tp"], runs["ep2xtp2"]["layout"]["ep"], runs["ep2xtp2"]["world_size"]) == (
        2,
        2,
        4,
    )
    assert (runs["pp2xep2"]["layout"]["pp"], runs["pp2xep2"]["layout"]["ep"]) == (2, 2)
    for name in ("ep2xtp2", "pp2xep2"):
        assert len(runs[name]["losses"]) == 6
        assert runs[name]["losses"] == pytest.approx(runs["ep1"]["losses"], rel=1e-5), name
        assert runs[name]["val_ppl"] == pytest.approx(runs["ep1"]["val_ppl"], rel=1e-5), name


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RUNS if RUNS[name][1]["model"] in third_party.MOE])
def test_expert_load_is_logged_on_logging_steps_as_the_routers_chose(name: str, results) -> None:
    """CuboidMonitor's ``moe/*`` figures, as the logger received them, on logging steps only; each equals the
    figure computed from the single-process reference's own router choices (the same tokens, summed over the
    data-parallel ranks that read them)."""
    spec = RUNS[name][1]
    ref = reference(name)
    logged = {int(row["step"]): row for row in results[name]["logged"] if "moe/load_imbalance" in row}
    pp = spec["strategy"].get("pipeline_parallel", 1)
    steps = range(LOG_EVERY if pp > 1 else 0, STEPS, LOG_EVERY)  # under pp: none from the shape-inference step
    assert len(logged) == len(steps), results[name]["logged"]
    for (at, row), step in zip(sorted(logged.items()), steps, strict=True):
        counts = ref.loads[step][: len(ref.loads[step]) // pp]  # (layers, experts) of rank 0's stage
        tokens = GLOBAL_BATCH * (spec.get("seq", SEQ) + 1)
        assert counts.sum() == 2 * tokens * counts.shape[0]  # top-2 of every token (padding too), every layer
        mean = counts.mean(dim=1)
        expected = {
            "moe/tokens_per_expert_max": float(counts.max()),
            "moe/tokens_per_expert_mean": float(mean.mean()),
            "moe/load_imbalance": float((counts.max(dim=1).values / mean).max()),
            "moe/idle_experts": float((counts == 0).sum()),
        }
        got = {k: row[k] for k in expected}
        assert got == pytest.approx(expected, rel=1e-6), (name, step, at, got, expected)
        assert got["moe/load_imbalance"] > 1.0  # routed unevenly


@pytest.mark.slow
def test_pretrained_weights_fill_each_ranks_experts(results, pretrained: Path) -> None:
    """``pretrained=`` a transformers directory at ep2, the model built on meta: the run equals one process started
    from those weights (each rank's experts are its slice of the file's packed tensors)."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(pretrained).state_dict()
    ref = third_party.reference_run("hf_qwen3_moe", dp=2, steps=STEPS, max_norm=QWEN["clip"], initial=initial)
    rel, err = parity_errors(results["ep2-pretrained"], ref)
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_an_ep2_checkpoint_exports_to_a_transformers_directory(results, pretrained: Path, tmp_path: Path) -> None:
    """``python -m cuboid.export CKPT OUT --config DIR`` on the checkpoint saved at ep2 (each rank its experts):
    ``from_pretrained(OUT)`` holds the single-process reference's weights after the same 6 steps."""
    from transformers import AutoModelForCausalLM

    run_checked([sys.executable, "-m", "cuboid.export", str(results["ep2-checkpoint"]), str(tmp_path / "hf"),
                 "--config", str(pretrained)], timeout=120)  # fmt: skip
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    ref = third_party.reference_run("hf_qwen3_moe", dp=2, steps=6, max_norm=QWEN["clip"])
    err = max((exported[k[len("model.") :]] - v).abs().max().item() for k, v in ref.params.items())
    assert err <= PARAM_ATOL, err
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # every expert, whatever the layout
