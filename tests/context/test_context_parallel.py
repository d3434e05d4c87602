"""Context parallel trains like one process: Cuboid's Llama at cp2 (with activation checkpointing), cp2 x dp2
(compiled blocks), cp2 x HSDP, cp2 x tp2 (sequence parallel), cp4 and pp2 x cp2; transformers Llama and Qwen3 at cp2
and cp2 x dp2 (padded batches, -100 labels: the loss is the whole sequence's token mean) and Qwen3 at pp2 x cp2
(Interleaved1F1B, padded); checkpoints move between cp2 and cp1 both ways; a sequence that cp cannot split stops
before the first step. Sequences of 64 tokens, the one parity bound (1e-5).

The LightningModules are the suite's usual ones (``parity_lib.LlamaModule``: its step shifts ``tokens[:, 1:]``
itself; ``third_party.HFModule``: the model's own loss from ``labels``), unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import third_party
from ahead import ahead
from harness import WORKERS, SpecRuns
from parity_lib import LOSS_RTOL, PARAM_ATOL, parity_errors, reference_run

SEQ = 64  # Cuboid's Llama reads tokens[:, :-1]: 64 tokens; a transformers model reads all 64 of seq + 1 = 64
HF_SEQ = SEQ - 1
STEPS = 6  # of the epoch's 12 (the reference stops there too)
# Max grad norms at 64 tokens, where the gradient norms differ from the suite's 32-token runs: the reference clips
# on some of the 6 steps and not on others (asserted below). Padded runs keep third_party's.
CLIP = {
    None: 1.3,
    "hf_llama": 1.65,
    "hf_qwen3": 1.7,
    "hf_gemma3": 1.9,
    "hf_mistral": 1.5,
    "hf_gpt_oss": 1.9,
    "hf_gemma2": 2.0,
}
CP2 = {"context_parallel": 2}

# name -> (world, spec); the reference of each is named by its model and padding.
RUNS: dict[str, tuple[int, dict]] = {
    "cp2-ac_full": (2, {"strategy": {**CP2, "activation_checkpointing": "full"}, "seq": SEQ}),
    "hf_llama-cp2": (2, {"model": "hf_llama", "strategy": CP2, "seq": HF_SEQ}),
    "hf_qwen3-cp2-padded": (2, {"model": "hf_qwen3", "strategy": CP2, "seq": HF_SEQ, "padded": True}),
    # sliding windows of 8 tokens, shorter than a rank's chunk (16): Mistral's every layer, Gemma 3's local ones
    "hf_mistral-cp2": (2, {"model": "hf_mistral", "strategy": CP2, "seq": HF_SEQ}),
    "hf_gemma3-cp2": (2, {"model": "hf_gemma3", "strategy": CP2, "seq": HF_SEQ}),
    # soft-capped attention scores, computed as written (eager): off by 4.25e-04 / 1.19e-02 with the cap left out
    "hf_gemma2-cp2": (2, {"model": "hf_gemma2", "strategy": CP2, "seq": HF_SEQ}),
    # attention sinks (a logit per head in every row's softmax) and sliding layers; its experts split over cp too
    "hf_gpt_oss-cp2xep2": (2, {"model": "hf_gpt_oss", "strategy": {**CP2, "expert_parallel": 2}, "seq": HF_SEQ}),
    "cp2xdp2-compile": (4, {"strategy": {**CP2, "compile": True}, "seq": SEQ}),
    "cp2xhsdp2": (4, {"strategy": {**CP2, "data_parallel_replicate": 2}, "seq": SEQ}),
    "cp2xtp2": (4, {"strategy": {**CP2, "tensor_parallel": 2}, "seq": SEQ}),
    "cp4": (4, {"strategy": {"context_parallel": 4}, "seq": SEQ}),
    "pp2xcp2": (4, {"strategy": {**CP2, "pipeline_parallel": 2}, "seq": SEQ}),
    "hf_llama-cp2xdp2-padded": (4, {"model": "hf_llama", "strategy": CP2, "seq": HF_SEQ, "padded": True}),
    "hf_qwen3-cp2xdp2": (4, {"model": "hf_qwen3", "strategy": CP2, "seq": HF_SEQ}),
    "hf_qwen3-pp2xcp2-Interleaved1F1B-padded": (
        4,
        {
            "model": "hf_qwen3",
            "strategy": {**CP2, "pipeline_parallel": 2, "pipeline_schedule": "Interleaved1F1B"},
            "seq": HF_SEQ,
            "padded": True,
        },
    ),
}
SAVE = {"max_steps": 7, "save_every": 6, "seq": SEQ, "clip": CLIP[None]}
RESUME = {"seq": SEQ, "clip": CLIP[None]}
ERRORS = {"err-seq-not-divisible": {"strategy": {"context_parallel": 2}, "seq": 62}}  # 62 % (2 x 2) = 2
TABLE: dict[str, tuple[float, float]] = {}


@pytest.fixture(scope="module")
@ahead
def launched(tmp_path_factory: pytest.TempPathFactory) -> SpecRuns:
    out = tmp_path_factory.mktemp("cp")
    got = SpecRuns(out)
    ckpt = [
        {"name": "cp2-save", "strategy": CP2, **SAVE, "save_dir": str(out / "cp2")},
        {"name": "dp2-from-cp2", "strategy": {}, **RESUME, "resume_from": str(out / "cp2" / "step=6.ckpt")},
        {"name": "dp2-save", "strategy": {}, **SAVE, "save_dir": str(out / "dp2")},
        {"name": "cp2-from-dp2", "strategy": CP2, **RESUME, "resume_from": str(out / "dp2" / "step=6.ckpt")},
    ]
    errors = [{"name": name, "expect_error": True, **spec} for name, spec in ERRORS.items()]
    for world in (2, 4):
        specs = [
            {
                "name": name,
                "max_steps": STEPS,
                **({} if spec.get("padded") else {"clip": CLIP[spec.get("model")]}),
                **spec,
            }
            for name, (w, spec) in RUNS.items()
            if w == world
        ]
        got.launch(world, WORKERS / "parity_worker.py", specs + (ckpt + errors if world == 2 else []))
    return got


@pytest.fixture(scope="module")
def results(launched: SpecRuns) -> Iterator[SpecRuns]:
    yield launched
    print("\ncontext parallel parity (max relative loss error, max absolute parameter error):")
    for name, (rel, err) in TABLE.items():
        print(f"  {name:26s} {rel:.1e} {err:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_context_parallel_matches_single_process(name: str, results) -> None:
    world, spec = RUNS[name]
    family, sizes = spec.get("model"), spec["strategy"]
    dp = world // (sizes["context_parallel"] * sizes.get("tensor_parallel", 1) * sizes.get("pipeline_parallel", 1))
    padded = spec.get("padded", False)
    if family is None:
        ref = reference_run(seq=SEQ, steps=STEPS, clip=CLIP[None])
        limit = CLIP[None]
    else:
        limit = third_party.clip(family, padded) if padded else CLIP[family]
        ref = third_party.reference_run(family, padded=padded, seq=HF_SEQ, dp=dp, steps=STEPS, max_norm=limit)
    clipped = [n > limit for n in ref.grad_norms]
    assert any(clipped) and not all(clipped), (name, ref.grad_norms)  # clipping is exercised, both ways
    assert len(results[name]["losses"]) == STEPS
    if name == "cp2xtp2":  # loss parallel stays on under cp: the logits are never gathered over tp
        assert all(r["loss_parallel"] for r in results[name]["ranks"])
    got = results[name]
    rel, err = parity_errors(got, ref)
    TABLE[name] = (rel, err)
    assert rel <= LOSS_RTOL, f"{name}: relative loss error {rel:.2e}"
    assert err <= PARAM_ATOL, f"{name}: parameter error {err:.2e}"
    # Every block's kernel call, forward and backward, was held to its CUDA twin's preconditions (CudaContracts);
    # Gemma 2's soft-capped blocks run written out on CPU (no aten kernel to check: tests/context/test_cuda_paths.py)
    for facts in [] if sizes.get("compile") else got["ranks"]:  # (Dynamo does not trace under a dispatch mode)
        checked = facts["cuda_contracts"]
        assert checked is not None and (checked or family == "hf_gemma2"), (name, checked)
        assert family == "hf_gemma2" or checked.get("_scaled_dot_product_flash_attention_for_cpu_backward"), checked
    # What the step logged (self.log, synced over dp only) is the whole sequence's loss too.
    logged = got["ranks"][0]["logged"]
    assert max(abs(a - b) / abs(b) for a, b in zip(logged, ref.losses, strict=True)) <= LOSS_RTOL
    # cp peers read the same batches; dp ranks different ones; parameters sharded over dp_shard x cp.
    by_dp: dict[int, list] = {}
    for facts in got["ranks"]:
        by_dp.setdefault(facts["dp_rank"], []).append(facts["seen"])
    assert len(by_dp) == dp and all(s == seen[0] for seen in by_dp.values() for s in seen)
    # every parameter sharded over dp_shard x cp; under ep the experts' over ep and the rest of dp_shard x cp
    experts = "expert_parallel" in sizes
    dims = {(".experts." in n and experts, tuple(d)) for f in got["ranks"] for n, (d, *_) in f["placements"].items()}
    assert all(("ep" in d and "efsdp" in d) if expert else ("dp_shard_cp" in d) for expert, d in dims), dims
    assert experts == any(expert for expert, _ in dims), dims
    if sizes.get("compile"):
        # The same 4 graphs for every block and step (the block's parts around attention, which runs eagerly:
        # torch.compiler.disable on the block attention, whose traced merges tripled the cold compile, 129 s -> 43 s):
        # nothing for Dynamo to recompile on. (A call counter the attention read once made each call recompile until
        # Dynamo's limit of 8, then run the blocks eagerly.)
        assert [r["compiled_graphs"] for r in got["ranks"]] == [4] * len(got["ranks"])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "saved"), [("dp2-from-cp2", "cp2-save"), ("cp2-from-dp2", "dp2-save")])
def test_checkpoints_move_between_cp2_and_cp1(name: str, saved: str, results) -> None:
    ref = reference_run(seq=SEQ, clip=CLIP[None])
    assert parity_errors(results[saved], ref, slice(0, 7))[0] <= LOSS_RTOL
    rel, err = parity_errors(results[name], ref, slice(6, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (name, rel, err)


@pytest.mark.slow
def test_a_sequence_cp_cannot_split_stops_before_the_first_step(results) -> None:
    error = results["err-seq-not-divisible"]["error"]
    assert "62 tokens cannot be split over context_parallel=2" in error and "multiple of 4" in error, error


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_qwen3-cp2xdp2", "hf_qwen3-pp2xcp2-Interleaved1F1B-padded"])
def test_every_config_of_a_transformers_model_uses_cuboids_attention(name: str, results) -> None:
    """Each pipeline stage's base model has a config of its own: left at sdpa, it built transformers' causal and
    padding mask on every stage and microbatch (a host sync on a GPU) that the attention then ignored."""
    for facts in results[name]["ranks"]:
        assert facts["attn_implementations"] == ["cuboid_cp"], facts["attn_implementations"]


def test_a_language_models_inputs_are_cut_with_their_multimodal_positions() -> None:
    """What the hook on a composite model's language model does with its call (one process, no group): the
    sequence's tensors and (sections, batch, seq) multimodal rotary positions (Qwen2-VL's, computed from each
    image's grid) are cut to this rank's tokens, and every argument goes by keyword (a decorator around a
    transformers forward fills use_cache when it does not find it among the keywords)."""
    import torch

    from cuboid.context import ContextParallel
    from cuboid.context.attention import local_positions
    from cuboid.context.current import running
    from cuboid.parallel import Layout

    class TextModel(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,  # noqa: ANN001, ANN202
                    use_cache=None, **kwargs):  # noqa: ANN001, ANN003  # fmt: skip
            return inputs_embeds

    cp = ContextParallel(Layout(cp=2))
    cp.rank = 1
    embeds, positions = torch.randn(2, 8, 4), torch.arange(8).expand(3, 2, 8) * 10
    with running(cp):
        args, kwargs = cp._shard_inputs(TextModel(), (), {"inputs_embeds": embeds, "position_ids": positions,
                                                           "use_cache": False})  # fmt: skip
    mine = local_positions(8, 1, 2, embeds.device)
    assert args == () and kwargs["use_cache"] is False
    assert torch.equal(kwargs["inputs_embeds"], embeds[:, mine]) and torch.equal(
        kwargs["position_ids"], positions[..., mine]
    )
    with running(cp), pytest.raises(Exception, match=r"cannot split position_ids of shape \(3, 2, 7\)"):
        cp._shard_inputs(TextModel(), (), {"inputs_embeds": embeds, "position_ids": positions[..., :7]})
