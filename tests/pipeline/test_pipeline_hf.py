"""Pipeline parallel on unmodified transformers decoders, in a LightningModule written the way users write one.

Schedules: 1F1B (the default), Interleaved1F1B with two stages per rank, ZBVZeroBubble, GPipe with an uneven
pipeline_split; composed with FSDP (dp), the model's own TP plan (tp) and both.

The step is ``self.model(input_ids=..., [attention_mask=..., ] labels=...).loss``; the model is
``AutoModelForCausalLM.from_config(...)`` (Llama, Qwen3, Mistral with a sliding window, Llama with tied
embeddings), never edited. Every layout must match single-process fp32 training of the same model within the one
parity bound (each step's loss within relative 1e-5, every final parameter element within absolute 1e-5), with
clipping on some steps and not on others.

Padded batches: samples of different lengths, padding masked by ``attention_mask`` and left out of the loss by
``-100`` labels, so the microbatches of one step hold different numbers of predicted tokens. Under pipeline
parallelism the loss is the model's own, weighted by the whole batch's token count: a step equals one big batch.
Under data parallelism each rank's loss is its own token mean (as under DDP or FSDP without pp), which is what the
reference computes for ``dp`` ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from harness import WORKERS, SpecRuns, python
from parity_lib import LOSS_RTOL, PARAM_ATOL, parity_errors
from torch.distributed.tensor import DTensor

third_party = pytest.importorskip("third_party")
pytest.importorskip("transformers")

PP2 = {"pipeline_parallel": 2}
TP2 = {"tensor_parallel": 2}
INTERLEAVED = {**PP2, "pipeline_schedule": "Interleaved1F1B", "virtual_stages": 2}


@dataclass(frozen=True)
class Run:
    world: int
    spec: dict

    @property
    def dp(self) -> int:
        tp = self.spec["strategy"].get("tensor_parallel", 1)
        return self.world // (self.spec["strategy"].get("pipeline_parallel", 1) * tp)


RUNS: dict[str, Run] = {
    "hf_llama-pp2": Run(2, {"model": "hf_llama", "strategy": PP2, "validate": True, "predict": True}),
    "hf_qwen3-pp2": Run(2, {"model": "hf_qwen3", "strategy": PP2}),
    "hf_mistral-pp2-padded": Run(2, {"model": "hf_mistral", "strategy": PP2, "padded": True}),
    "hf_llama_tied-pp2": Run(2, {"model": "hf_llama_tied", "strategy": PP2}),
    "hf_qwen3-interleaved_v2-padded": Run(2, {"model": "hf_qwen3", "strategy": INTERLEAVED, "padded": True}),
    "hf_qwen3-pp2-ZBVZeroBubble": Run(
        2, {"model": "hf_qwen3", "strategy": {**PP2, "pipeline_schedule": "ZBVZeroBubble"}}
    ),
    # activation checkpointing under a zero-bubble schedule: each block recomputed for its input gradients and again
    # for its weights'; with experts split over ranks, their exchanged counts replayed in both recomputes
    "hf_qwen3-pp2-ZBVZeroBubble-ac_full": Run(
        2,
        {
            "model": "hf_qwen3",
            "strategy": {**PP2, "pipeline_schedule": "ZBVZeroBubble", "activation_checkpointing": "full"},
        },
    ),
    "hf_qwen3_moe_noaux-pp2xep2-ZBVZeroBubble-ac_selective": Run(
        4,
        {
            "model": "hf_qwen3_moe_noaux",
            "strategy": {
                **PP2,
                "expert_parallel": 2,
                "pipeline_schedule": "ZBVZeroBubble",
                "microbatches": 4,
                "activation_checkpointing": "selective",
            },
        },
    ),  # fmt: skip
    "hf_llama-pp2-GPipe-split_1_3": Run(
        2, {"model": "hf_llama", "strategy": {**PP2, "pipeline_schedule": "GPipe", "pipeline_split": [1, 3]}}
    ),
    "hf_llama-pp2xdp2-padded": Run(4, {"model": "hf_llama", "strategy": PP2, "padded": True}),
    "hf_qwen3-pp2xtp2": Run(
        4, {"model": "hf_qwen3", "strategy": {**PP2, **TP2}, "predict": True, "whole_after_fit": True}
    ),  # fmt: skip
    "hf_llama-pp2xdp2xtp2-padded": Run(8, {"model": "hf_llama", "strategy": {**PP2, **TP2}, "padded": True}),
}


# Checkpoints: Qwen3 saved at step 6 of 12 (sharded) at pp2 and at dp2, each resumed on the other layout.
SAVES = {"hf_qwen3-pp2-save": PP2, "hf_qwen3-dp2-save": {}}
RESUMES = {
    "hf_qwen3-from-pp2-to-dp2": ("hf_qwen3-pp2-save", {}),
    "hf_qwen3-from-dp2-to-pp2": ("hf_qwen3-dp2-save", PP2),
}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("pipeline_hf")


@pytest.fixture(scope="module")
def pretrained_dir(out):
    """A transformers directory (save_pretrained) of other weights than every run starts from."""
    torch.manual_seed(99)
    model = third_party.build_model("hf_llama")
    model.save_pretrained(out / "hf_llama_pretrained")
    return out / "hf_llama_pretrained"


@pytest.fixture(scope="module")
def results(out, pretrained_dir) -> dict[str, dict]:
    launches: dict[int, list[dict]] = {}
    for name, run in RUNS.items():
        launches.setdefault(run.world, []).append({"name": name, **run.spec})
    for name, strategy in SAVES.items():
        save = {"max_steps": 7, "save_every": 6, "save_dir": str(out / name)}
        launches[2].append({"name": name, "model": "hf_qwen3", "strategy": strategy, **save})
    for name, (saved, strategy) in RESUMES.items():
        resume = str(out / saved / "step=6.ckpt")
        launches[2].append({"name": name, "model": "hf_qwen3", "strategy": strategy, "resume_from": resume})
    launches[4].append(
        {
            "name": "hf_llama-pp2xtp2-pretrained",
            "model": "hf_llama",
            "meta_init": True,
            "strategy": {**PP2, **TP2, "pretrained": {"model": str(pretrained_dir)}},
            "max_steps": 1,
        }
    )
    got = SpecRuns(out)
    for world in sorted(launches):
        got.launch(world, WORKERS / "parity_worker.py", launches[world], timeout=900)
    return got


@pytest.fixture(scope="module")
def references() -> dict[tuple, object]:
    keys = {(r.spec["model"], r.spec.get("padded", False), r.dp) for r in RUNS.values()}
    return {key: third_party.reference_run(key[0], padded=key[1], dp=key[2]) for key in keys}


def test_padded_microbatches_hold_different_token_counts() -> None:
    """What the padded runs test: within one rank's batch, microbatches predict different numbers of tokens."""
    data = third_party.dataset("hf_llama", padded=True)
    counts = [int((data[i]["labels"][1:] != -100).sum()) for i in range(8)]
    assert len(set(counts)) > 2, counts


def test_references_clip_on_some_steps_only(references) -> None:
    for (family, padded, _), ref in references.items():
        clipped = [n > third_party.clip(family, padded) for n in ref.grad_norms]
        assert any(clipped) and not all(clipped), (family, ref.grad_norms)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_unmodified_transformers_decoder_under_pipeline_matches_single_process(name: str, results, references) -> None:
    run = RUNS[name]
    got, ref = results[name], references[(run.spec["model"], run.spec.get("padded", False), run.dp)]
    assert set(got["params"]) >= set(ref.params), sorted(set(ref.params) - set(got["params"]))[:3]
    rel, err = parity_errors(got, ref)
    print(f"{name}: max rel loss err {rel:.2e}, max abs param err {err:.2e}")
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, f"{name}: loss {rel:.2e}, params {err:.2e}"
    assert got["ranks"][0]["schedule"] is not None  # the pipeline really ran


@pytest.mark.slow
def test_stages_hold_only_their_own_blocks_under_the_models_names(results) -> None:
    """pp2: rank 0 holds the embedding and blocks 0-1, rank 1 blocks 2-3, the final norm and the head, each under
    the whole model's names; with tp2 the model's own plan shards them."""
    by_rank = {facts["rank"]: set(facts["placements"]) for facts in results["hf_qwen3-pp2xtp2"]["ranks"]}
    first, last = by_rank[0], by_rank[max(by_rank)]
    assert "model.model.embed_tokens.weight" in first and "model.model.embed_tokens.weight" not in last
    assert "model.lm_head.weight" in last and "model.lm_head.weight" not in first
    assert any(n.startswith("model.model.layers.0.") for n in first) and not any(
        n.startswith("model.model.layers.3.") for n in first
    )
    assert any(n.startswith("model.model.layers.3.") for n in last)
    placements = results["hf_qwen3-pp2xtp2"]["ranks"][0]["placements"]
    assert placements["model.model.layers.0.self_attn.o_proj.weight"][1][-1] == "S(1)"  # rowwise, the model's plan


@pytest.mark.slow
def test_after_a_pipeline_run_the_whole_weights_come_from_every_stage(results) -> None:
    """After fit and predict at pp2 x tp2 the model stays split (issue 66, item 3): ``cuboid.whole_state_dict``
    (every rank) gives every stage's weights whole, in the model's order, equal to the run's final weights; a
    library method (transformers' ``get_input_embeddings``) is refused by name, saying what to call instead."""
    got = results["hf_qwen3-pp2xtp2"]
    whole, final = got["kept"]["whole"], got["params"]
    assert next(iter(whole)) == "model.model.embed_tokens.weight" and "model.lm_head.weight" in whole
    assert set(final) <= set(whole), sorted(set(final) - set(whole))[:3]
    assert all(torch.equal(whole[k].float(), v.float()) for k, v in final.items())
    assert not any(isinstance(v, DTensor) for v in whole.values())
    said = got["kept"]["method"]  # by rank; ranks 0 and 1 hold the first stage, with the embedding
    assert said[0] == said[1] == "Embedding", said
    for other in said[2:]:  # the last stage: the method runs, or fails and is refused by name
        assert other in ("Embedding", "NoneType") or other.startswith(
            "Qwen3ForCausalLM.get_input_embeddings() after the run: CuboidStrategy keeps the model split "
            "(pipeline_parallel=2"), said  # fmt: skip


@pytest.mark.slow
def test_validation_under_pipeline_gives_the_single_process_value(results, references) -> None:
    """trainer.fit's validation (a forward-only schedule, the user's validation_step and its MeanMetric per
    microbatch) after the last step equals the reference model's mean batch loss on the same batches."""
    from torch.utils.data import DataLoader

    ref = references[("hf_llama", False, 1)]
    model = third_party.initial_model("hf_llama")
    model.load_state_dict({k[len("model.") :]: v for k, v in ref.params.items()})
    with torch.no_grad():
        losses = [float(third_party.hf_loss(model, b)) for b in DataLoader(third_party.dataset("hf_llama"), 8)]
    expected = sum(losses) / len(losses)
    for facts in results["hf_llama-pp2"]["ranks"]:
        assert abs(facts["val_loss"] - expected) / expected <= LOSS_RTOL, (facts["val_loss"], expected)


def test_predictions_of_microbatches_join_into_the_batchs() -> None:
    """What predict_step returns per microbatch, as one batch's: tensors along the batch, lists (one item per
    sample) concatenated, dicts, tuples and transformers' outputs place by place, anything else listed."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from cuboid.pipeline.results import join

    one, two = torch.arange(4.0).reshape(2, 2), torch.arange(4.0, 6.0).reshape(1, 2)
    got = join([{"logits": one, "ids": ["a", "b"], "pair": (one, 1)}, {"logits": two, "ids": ["c"], "pair": (two, 2)}])
    assert torch.equal(got["logits"], torch.arange(6.0).reshape(3, 2)) and got["ids"] == ["a", "b", "c"]
    assert torch.equal(got["pair"][0], got["logits"]) and got["pair"][1] == [1, 2]
    out = join([CausalLMOutputWithPast(logits=one), CausalLMOutputWithPast(logits=two)])
    assert isinstance(out, CausalLMOutputWithPast) and out.logits.shape == (3, 2) and out.loss is None
    assert torch.equal(join([torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("name", ["hf_llama-pp2", "hf_qwen3-pp2xtp2"])
def test_predict_under_pipeline_gives_every_rank_the_models_predictions(name: str, results) -> None:
    """trainer.predict after fit: every rank (both stages, both tp ranks) returns, batch after batch, the logits one
    process computes with the run's final weights (the last stage's, its microbatches joined)."""
    got = results[name]
    model = third_party.build_model(RUNS[name].spec["model"])
    model.load_state_dict({k.removeprefix("model."): v for k, v in got["params"].items()})
    data = third_party.dataset(RUNS[name].spec["model"])
    with torch.no_grad():
        want = torch.cat(
            [third_party.hf_logits(model, {"tokens": torch.stack([data[i]["tokens"] for i in range(k, k + 8)])})
             for k in range(0, len(data), 8)]
        )  # fmt: skip
    for facts in got["ranks"]:
        assert facts["predictions"].shape == want.shape, (facts["rank"], facts["predictions"].shape)
        err = (facts["predictions"] - want).abs().max()
        assert err <= 1e-5, (facts["rank"], float(err))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoint_from_pipeline_resumes_on_another_layout_and_back(name: str, results, references) -> None:
    """Qwen3 saved at pp2 resumes at dp2, and saved at dp2 resumes at pp2, on the single-process curve."""
    ref = references[("hf_qwen3", False, 1)]
    rel, err = parity_errors(results[name], ref, slice(6, None))
    print(f"{name}: max rel loss err {rel:.2e}, max abs param err {err:.2e}")
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, f"{name}: loss {rel:.2e}, params {err:.2e}"


@pytest.mark.slow
def test_pretrained_under_pp2_x_tp2_gives_from_pretrained_first_loss(results, pretrained_dir) -> None:
    """pretrained= on a model built on meta, at pp2 x tp2 (each stage reads its own tensors, tp slices of them):
    the first step's loss equals transformers' from_pretrained on the same files."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained_dir)
    data = third_party.dataset("hf_llama")
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(third_party.SEED)).tolist()
    items = [data[i] for i in perm[: third_party.GLOBAL_BATCH]]
    with torch.no_grad():
        expected = float(third_party.hf_loss(model, {k: torch.stack([it[k] for it in items]) for k in items[0]}))
    got = results["hf_llama-pp2xtp2-pretrained"]["losses"][0]
    print(f"pretrained pp2 x tp2 first loss {got:.6f}, from_pretrained {expected:.6f}")
    assert abs(got - expected) / expected <= LOSS_RTOL, (got, expected)


@pytest.mark.slow
def test_export_of_a_pipeline_checkpoint_loads_in_transformers(results, out) -> None:
    """python -m cuboid.export --config: a pp2 checkpoint becomes a transformers directory whose weights are the
    checkpoint's, under the model's own names."""
    import sys

    import transformers

    from cuboid import read_model_weights

    ckpt, target = out / "hf_qwen3-pp2-save" / "step=6.ckpt", out / "qwen3-export"
    third_party.hf_config("hf_qwen3").save_pretrained(out / "qwen3-config")
    cmd = [sys.executable, "-m", "cuboid.export", str(ckpt), str(target), "--config", str(out / "qwen3-config")]
    done = python(cmd, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    saved = read_model_weights(ckpt)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[f"model.{name}"]), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_qwen3-pp2xtp2", "hf_llama-pp2xdp2xtp2-padded", "hf_llama_tied-pp2"])
def test_fit_estimate_knows_stages_of_a_transformers_model(name: str, results) -> None:
    """Setup's fit check counts each pp rank's own stages (the decoder's split) before sharding: within 10% of the
    parameter bytes each rank holds."""
    from parity_lib import fit_estimate_error

    worst = fit_estimate_error(results[name]["ranks"])
    print(f"{name}: fit estimate worst |est/meas - 1| = {worst:.2%}")
    assert worst <= 0.10, worst


# ---------------------------------------------------------------- in one process: the stages are the model


def _lm(model: torch.nn.Module) -> torch.nn.Module:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

    return Module()


def _qwen3_mixed_windows():
    """Qwen3 whose later blocks use a sliding window of 4 (a per-layer mask the base model picks by position)."""
    import transformers

    config = third_party.hf_config("hf_qwen3")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 2
    config.layer_types = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _other_family(name: str):
    """Decoders no other test names, built from tiny configs: they must follow with no code of their own."""
    import transformers

    small = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    configs = {
        "gemma": lambda: transformers.GemmaConfig(head_dim=16, **small),  # scales embeddings in its embedding module
        "gemma2": lambda: transformers.Gemma2Config(  # alternating sliding windows, attention and logit soft-capping
            head_dim=16, sliding_window=4, final_logit_softcapping=30.0, **small
        ),
        "qwen2": lambda: transformers.Qwen2Config(**small),  # biases on q/k/v
        "phi3": lambda: transformers.Phi3Config(pad_token_id=0, **small),  # fused qkv and gate_up projections
        "olmo2": lambda: transformers.Olmo2Config(**small),  # norms after attention and MLP
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[name]())


OTHER_FAMILIES = ["gemma", "gemma2", "qwen2", "phi3", "olmo2"]


@pytest.mark.parametrize("family", ["hf_llama", "hf_llama_tied", "hf_mistral", "qwen3_mixed_windows", *OTHER_FAMILIES])
def test_two_stages_compute_what_the_model_computes(family: str) -> None:
    """The decoder's stages, run one after the other on a padded batch, give the model's own logits, and the
    microbatches' weighted losses add up to the model's loss on the whole batch."""
    from cuboid.parallel.plans import find_blocks
    from cuboid.pipeline import decoder_call
    from cuboid.pipeline.stages import build_stages, find_pipeline_split, stage_blocks

    torch.manual_seed(0)
    if family in OTHER_FAMILIES:
        model = _other_family(family)
    else:
        model = _qwen3_mixed_windows() if family == "qwen3_mixed_windows" else third_party.build_model(family)
    model.eval()  # (dropout off where a family has it)
    data = third_party.dataset("hf_llama", padded=True)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("tokens", "attention_mask", "labels")}
    with torch.no_grad():
        want = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        lm = _lm(model)
        split = find_pipeline_split(lm, find_blocks(lm))
        assert split.shape is not None and (split.container, split.pre) == ("model.layers", ["model.embed_tokens"])
        assert split.post == ["model.norm", "lm_head"]
        per_stage = stage_blocks(len(split.block_keys), 2, None)
        # each pp rank has its own copy of the model, pruned to its stages
        _, (first,) = build_stages(copy.deepcopy(model), split, [0], per_stage)
        _, (last,) = build_stages(copy.deepcopy(model), split, [1], per_stage)
        hidden = first(batch["tokens"], attention_mask=batch["attention_mask"])
        logits = last(hidden, attention_mask=batch["attention_mask"])
        assert torch.allclose(logits, want.logits, rtol=0, atol=1e-6), (logits - want.logits).abs().max()
        plan = decoder_call.bind_call(
            model, (), {"input_ids": batch["tokens"], "attention_mask": batch["attention_mask"],
                        "labels": batch["labels"]}, "training_step", "model")  # fmt: skip
        losses = [
            decoder_call.microbatch_output(model, lg, (), {"labels": lb}, plan.predicted_tokens(), 2).loss
            for lg, lb in zip(logits.tensor_split(2), batch["labels"].tensor_split(2), strict=True)
        ]
    counts = [int((lb[:, 1:] != -100).sum()) for lb in batch["labels"].tensor_split(2)]
    assert counts[0] != counts[1], counts  # the weighting matters here
    assert abs(float(sum(losses) / 2) - float(want.loss)) <= 1e-6 * float(want.loss)


@pytest.mark.parametrize("family", ["hf_granite", "hf_gpt2"])
def test_what_the_forward_does_around_its_blocks_runs_once(family: str) -> None:
    """Granite multiplies inputs_embeds by embedding_multiplier, GPT-2 adds learned positions (``wpe``) and reshapes
    after its blocks, all inside the base model's forward: three stages run one after the other give the model's
    own logits on a padded batch (the middle stage's first block gets the hidden states it received, its ``wpe``
    (and embedding) stand in by shape only, holding no parameters; the model itself keeps its pieces and values).
    (Parity at pp2 and pp2 x tp2: tests/models/test_third_party.py.)"""
    from cuboid.parallel.plans import find_blocks
    from cuboid.pipeline.decoder_probe import ShapeOnly
    from cuboid.pipeline.stages import build_stages, find_pipeline_split, stage_blocks

    torch.manual_seed(0)
    model = third_party.build_model(family).eval()
    data = third_party.dataset(family, padded=True)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("tokens", "attention_mask")}
    lm = _lm(model)
    split = find_pipeline_split(lm, find_blocks(lm))
    with torch.no_grad():
        want = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"]).logits
        x = batch["tokens"]
        for stage_id in range(3):
            _, (stage,) = build_stages(copy.deepcopy(model), split, [stage_id], stage_blocks(4, 3, [1, 2, 1]))
            if stage_id == 1:
                base = stage.transformer if family == "hf_gpt2" else stage.model
                pieces = ["wte", "wpe"] if family == "hf_gpt2" else ["embed_tokens"]
                assert all(isinstance(getattr(base, n), ShapeOnly) for n in pieces)
                assert not any(".wpe." in n or "embed" in n or ".wte." in n for n, _ in stage.named_modules())
            x = stage(x, attention_mask=batch["attention_mask"])
    assert torch.allclose(x, want, rtol=0, atol=1e-6), (x - want).abs().max()
    if family == "hf_granite":
        assert model.model.embedding_multiplier == 12.0


def test_a_composite_model_that_computes_its_positions_from_the_images_is_refused() -> None:
    """Qwen2-VL computes its language model's multimodal rotary positions from each image's grid inside its composite
    forward: a later stage, the language model alone, could not rebuild them (cp and tp take it)."""
    import transformers

    from cuboid.parallel.plans import find_blocks
    from cuboid.pipeline.stages import PipelineError, find_pipeline_split

    vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "patch_size": 4, "spatial_merge_size": 2}
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}}  # fmt: skip
    config = transformers.Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=63)
    lm = _lm(transformers.Qwen2VLForConditionalGeneration(config))
    with pytest.raises(PipelineError, match="Qwen2VLModel computes its language model's positions itself"):
        find_pipeline_split(lm, find_blocks(lm))


def test_a_step_whose_keyword_tensors_cannot_be_split_is_refused() -> None:
    from cuboid.pipeline import decoder, decoder_call

    model = third_party.build_model("hf_llama")
    ids = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(decoder.DecoderSplitError, match=r"position_ids of shape \(8,\) .* batch size 4"):
        decoder_call.bind_call(model, (), {"input_ids": ids, "position_ids": torch.arange(8)}, "training_step", "model")
    with pytest.raises(decoder.DecoderSplitError, match="without input_ids"):
        decoder_call.bind_call(model, (), {"inputs_embeds": torch.zeros(4, 8, 64)}, "training_step", "model")
    with pytest.raises(decoder.DecoderSplitError, match="output_hidden_states=True"):
        decoder_call.bind_call(model, (ids,), {"output_hidden_states": True}, "training_step", "model")


def test_a_step_that_calls_the_model_twice_is_refused() -> None:
    from cuboid.pipeline.runner import _StageOutput
    from cuboid.pipeline.stages import PipelineError

    standin = _StageOutput(torch.nn.Linear(2, 2), torch.zeros(1), "training_step", "model", None)
    standin(torch.zeros(1))
    with pytest.raises(PipelineError, match="calls self.model\\(...\\) 2 times in one step"):
        standin(torch.zeros(1))


@pytest.mark.slow
def test_dry_run_counts_each_stage_of_a_transformers_model(results) -> None:
    """python -m cuboid.dryrun's count for Qwen3 at pp2 x tp2 (built on meta, never parallelized) equals the
    parameter bytes each pp rank held in the real run."""
    import lightning as L

    from cuboid.parallel.mesh import Layout
    from cuboid.planning import dry_run

    class OnMeta(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.model = third_party.build_model("hf_qwen3")

    report = dry_run(OnMeta(), Layout(pp=2, dp_shard=1, tp=2))
    ranks = results["hf_qwen3-pp2xtp2"]["ranks"]
    measured = [max(f["bytes"]["params"] for f in ranks if f["rank"] // 2 == pp) for pp in range(2)]
    assert report.per_pp_rank == measured, (report.per_pp_rank, measured)


def test_predict_under_pipeline_and_context_parallel_is_refused() -> None:
    """Under pp x cp each cp rank's last stage holds only its share of every sequence: trainer.predict is refused with
    the reason (validation and test, which average a loss, run)."""
    from types import SimpleNamespace

    from cuboid.parallel import Layout
    from cuboid.pipeline import Pipelining
    from cuboid.pipeline.stages import PipelineError

    pipelining = Pipelining(Layout(pp=2, cp=2))
    pipelining.runner = SimpleNamespace(context=object())  # the runner of a pp x cp run: it holds cp's runtime
    with pytest.raises(PipelineError, match="trainer.predict with pipeline_parallel and context_parallel"):
        pipelining.eval_step(None, "predict_step", {}, 0, None, torch.device("cpu"))
