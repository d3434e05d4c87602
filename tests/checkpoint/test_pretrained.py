"""Pretrained weights into the sharded layout: ``CuboidStrategy(pretrained={"model": PATH})``.

Parity from the first step: a model built on meta and filled from weights on disk trains exactly like
single-process fp32 training started from those weights (the bound of test_parity), for a transformers Llama
(its own names) and Cuboid's Llama (Hugging Face names through its adapter, an exported single file, a Cuboid
checkpoint sharded or full). Exactness: Cuboid's Llama with Llama 3 rope scaling and tied embeddings, filled
from a directory transformers wrote, gives transformers' logits within 1e-5 under dp2 x tp2 and pp2; and export
-> ``pretrained=`` gives back identical logits. Bad sources fail before any work, with the list.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from harness import WORKERS, SpecRuns, run_checked, torchrun
from parity_lib import LOSS_RTOL, PARAM_ATOL, parity_errors
from parity_lib import initial_model as llama_initial_model
from parity_lib import reference_run as llama_reference

from cuboid.checkpoint.pretrained import PretrainedError, plan_submodule
from cuboid.models.llama import LlamaConfig, hf_config, to_hf_llama

third_party = pytest.importorskip("third_party")
transformers = pytest.importorskip("transformers")

TP2 = {"tensor_parallel": 2}
PP2 = {"pipeline_parallel": 2}


def save_llama_as_hf(directory: Path, state: dict[str, torch.Tensor], cfg: LlamaConfig) -> Path:
    """What ``python -m cuboid.export --hf`` writes: model.safetensors + config.json."""
    from safetensors.torch import save_file

    weights, config = to_hf_llama(state, cfg)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# The "pretrained" weights: another seed than the one the modules' own (meta) init uses, so a run that skipped
# loading would start elsewhere and fail parity.
PRETRAINED_SEED = 99


@pytest.fixture(scope="module")
def weights() -> dict[str, dict[str, torch.Tensor]]:
    from cuboid.models.llama import Llama

    torch.manual_seed(PRETRAINED_SEED)
    hf = third_party.build_model("hf_llama")
    torch.manual_seed(PRETRAINED_SEED)
    llama = Llama(llama_initial_model().cfg)
    for mine, init in ((hf, third_party.initial_model("hf_llama", meta_init=True)), (llama, llama_initial_model())):
        assert not torch.equal(next(iter(mine.state_dict().values())), next(iter(init.state_dict().values())))
    return {"hf_llama": hf.state_dict(), "llama": llama.state_dict()}


@pytest.fixture(scope="module")
def sources(weights, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("weights")
    hf = third_party.build_model("hf_llama")
    hf.load_state_dict(weights["hf_llama"])
    hf.save_pretrained(root / "hf_llama")  # one model.safetensors
    hf.save_pretrained(root / "hf_llama_sharded", max_shard_size="100KB")  # an index and several files
    assert (root / "hf_llama_sharded" / "model.safetensors.index.json").is_file()
    llama = llama_initial_model()
    llama.load_state_dict(weights["llama"])
    save_llama_as_hf(root / "llama_hf", llama.state_dict(), llama.cfg)
    # what `python -m cuboid.export CKPT OUT.safetensors` writes: the LightningModule's names
    save_file({f"model.{k}": v.contiguous() for k, v in llama.state_dict().items()}, root / "llama.safetensors")
    return {p.name: p for p in root.iterdir()}


RUNS = {
    # name: (processes, parity worker spec); every model is built on meta and filled from `pretrained`
    "hf_llama-dp2": (2, {"model": "hf_llama", "strategy": {}, "pretrained": "hf_llama"}),
    "hf_llama-dp2xtp2-sharded_files": (4, {"model": "hf_llama", "strategy": TP2, "pretrained": "hf_llama_sharded"}),
    "llama-dp2-hf_names": (2, {"strategy": {}, "pretrained": "llama_hf"}),
    "llama-dp2xtp2-hf_names": (4, {"strategy": TP2, "pretrained": "llama_hf"}),
    "llama-pp2-hf_names": (2, {"strategy": PP2, "pretrained": "llama_hf"}),
    "llama-pp2xdp2-exported_file": (4, {"strategy": PP2, "pretrained": "llama.safetensors"}),
    "llama-dp2-cuboid_sharded": (2, {"strategy": {}, "pretrained": "ckpt-sharded"}),
    "llama-dp2-cuboid_full": (2, {"strategy": {}, "pretrained": "ckpt-full.ckpt"}),
}


@pytest.fixture(scope="module")
def results(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("pretrained")
    root = next(iter(sources.values())).parent
    launches: dict[int, list[dict]] = {2: [], 4: []}
    # Cuboid checkpoints of the pretrained weights (loaded, fit of zero steps, saved): sharded and full.
    for fmt, name in (("sharded", "ckpt-sharded"), ("full", "ckpt-full.ckpt")):
        launches[2].append(
            {
                "name": f"save-{fmt}",
                "strategy": {"checkpoint_format": fmt, "pretrained": {"model": str(root / "llama_hf")}},
                "meta_init": True,
                "max_steps": 0,
                "save_after_fit": str(root / name),
            }  # fmt: skip
        )
    for name, (world, spec) in RUNS.items():
        strategy = {**spec["strategy"], "pretrained": {"model": str(root / spec["pretrained"])}}
        launches[world].append({**spec, "name": name, "meta_init": True, "strategy": strategy})
    # A source that does not fit stops every rank before training, with the list (no rank hangs).
    launches[2].append(
        {
            "name": "wrong-model",
            "model": "hf_llama",
            "meta_init": True,
            "expect_error": True,
            "strategy": {"pretrained": {"model": str(root / "llama.safetensors")}},
        }  # fmt: skip
    )
    got = SpecRuns(out)
    for world in (2, 4):
        got.launch(world, WORKERS / "parity_worker.py", launches[world])
    return got


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_pretrained_run_matches_single_process_from_the_first_step(name: str, results, weights) -> None:
    spec = RUNS[name][1]
    family = spec.get("model", "llama")
    if family == "llama":
        ref = llama_reference(initial=weights[family])
    else:
        ref = third_party.reference_run(family, initial={k: v for k, v in weights[family].items()})
    got = results[name]
    rel, err = parity_errors(got, ref)
    print(f"{name}: first loss {got['losses'][0]:.6f} (reference {ref.losses[0]:.6f}); rel {rel:.2e}, param {err:.2e}")
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, f"{name}: loss {rel:.2e}, params {err:.2e}"


@pytest.mark.slow
def test_wrong_weights_stop_every_rank_before_training(results) -> None:
    error = results["wrong-model"]["error"]
    assert error is not None and error.startswith("PretrainedError"), error
    assert "missing 'model.embed_tokens.weight'" in error and "unexpected" in error, error


# ---------------------------------------------------------------------------------------------- Llama 3 exactness
TINY = LlamaConfig(
    vocab_size=128,
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    max_seq_len=4096,
    rope_theta=500000.0,
    rope_scaling=8.0,
    rope_original_max_seq_len=64,
    tie_embeddings=True,
)  # fmt: skip  (original length 64: the scaling changes this head size's frequencies)


@pytest.fixture(scope="module")
def exactness(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import dataclasses

    root = tmp_path_factory.mktemp("exactness")
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(TINY).items() if k != "architectures"})
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(config)
    assert hf.model.rotary_emb.rope_type == "llama3" and hf.lm_head.weight is hf.model.embed_tokens.weight
    hf.save_pretrained(root / "hf")
    tokens = torch.randint(0, TINY.vocab_size, (8, 24), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, root / "tokens.pt")
    with torch.no_grad():
        reference = hf(tokens).logits
    cfg = dataclasses.asdict(TINY)
    base = {"cfg": cfg, "tokens": str(root / "tokens.pt")}
    first = [
        {**base, "name": "hf-pp2", "strategy": {**PP2, "pretrained": {"model": str(root / "hf")}}},
        # fine-tune two steps from the Hugging Face weights, save, and keep the logits to compare the export with
        {
            **base,
            "name": "tuned-dp2",
            "fit_steps": 2,
            "clip": CLIP,
            "save_to": str(root / "tuned"),
            "strategy": {"pretrained": {"model": str(root / "hf")}},
        },
        # the same under pp2: the tied embedding lives on both end stages, its gradient summed, its norm counted once
        {
            **base,
            "name": "tuned-pp2",
            "fit_steps": 2,
            "clip": CLIP,
            "strategy": {**PP2, "pretrained": {"model": str(root / "hf")}},
        },
    ]
    torchrun(2, WORKERS / "logits_worker.py", str(root), json.dumps(first))
    torchrun(4, WORKERS / "logits_worker.py", str(root), json.dumps([
        {**base, "name": "hf-dp2xtp2", "strategy": {**TP2, "pretrained": {"model": str(root / "hf")}}},
    ]))  # fmt: skip
    (root / "tiny.yaml").write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in cfg.items()))
    export = [sys.executable, "-m", "cuboid.export", str(root / "tuned")]
    run_checked([*export, str(root / "tuned.safetensors")], timeout=120)
    run_checked([*export, str(root / "tuned_hf"), "--hf", str(root / "tiny.yaml")], timeout=120)
    second = [
        {**base, "name": f"back-{name}", "strategy": {**layout, "pretrained": {"model": str(root / src)}}}
        for name, layout, src in [
            ("file-dp2", {}, "tuned.safetensors"),
            ("ckpt-dp2", {}, "tuned"),
            ("hf-pp2", PP2, "tuned_hf"),
        ]
    ]
    torchrun(2, WORKERS / "logits_worker.py", str(root), json.dumps(second))
    runs = ["hf-pp2", "tuned-dp2", "tuned-pp2", "hf-dp2xtp2", "back-file-dp2", "back-ckpt-dp2", "back-hf-pp2"]
    return {"reference": reference, **{name: torch.load(root / f"{name}.pt") for name in runs}}


CLIP = 0.5  # below the gradient norm of every step: clipping is active, so a norm counted wrong would show


def _stack(result: dict | torch.Tensor) -> torch.Tensor:
    if torch.is_tensor(result):
        return result
    logits = result["logits"]
    return torch.stack([logits[i] for i in sorted(logits)])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-dp2xtp2", "hf-pp2"])
def test_llama3_logits_equal_transformers(name: str, exactness) -> None:
    got, ref = _stack(exactness[name]), _stack(exactness["reference"])
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    print(f"{name}: max |logits - transformers| = {err:.2e}")
    assert err <= 1e-5, err


@pytest.mark.slow
def test_export_then_pretrained_gives_back_the_same_logits(exactness) -> None:
    tuned = _stack(exactness["tuned-dp2"])
    assert (tuned - _stack(exactness["reference"])).abs().max() > 1e-3  # the fine-tuning really changed the model
    assert torch.equal(_stack(exactness["back-file-dp2"]), tuned)  # same layout: bit for bit
    assert torch.equal(_stack(exactness["back-ckpt-dp2"]), tuned)
    err = (_stack(exactness["back-hf-pp2"]) - tuned).abs().max().item()
    print(f"export --hf -> pretrained= under pp2: max |logits diff| = {err:.2e}")
    assert err <= 1e-5, err


@pytest.mark.slow
def test_tied_embeddings_train_alike_across_pipeline_stages(exactness) -> None:
    dp2, pp2 = exactness["tuned-dp2"], exactness["tuned-pp2"]
    assert dp2["grad_norm"] > CLIP, dp2["grad_norm"]
    assert abs(pp2["grad_norm"] - dp2["grad_norm"]) <= 1e-5 * dp2["grad_norm"], (pp2["grad_norm"], dp2["grad_norm"])
    err = (_stack(pp2) - _stack(dp2)).abs().max().item()
    print(f"tied embeddings, 2 clipped steps: pp2 vs dp2 max |logits diff| = {err:.2e}")
    assert err <= 1e-5, err


# ---------------------------------------------------------------------------------------------- bad sources
class Holder(torch.nn.Module):
    """A LightningModule's shape: the model under ``model``, built on meta."""

    def __init__(self, cfg: LlamaConfig = TINY) -> None:
        super().__init__()
        from cuboid.models.llama import Llama

        with torch.device("meta"):
            self.model = Llama(cfg)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cuboid.models.llama import Llama

    torch.manual_seed(0)
    return save_llama_as_hf(tmp_path_factory.mktemp("tiny") / "hf", Llama(TINY).state_dict(), TINY)


def _error(tmp: Path, path: Path | str, holder: torch.nn.Module | None = None, sub: str = "model") -> str:
    with pytest.raises(PretrainedError) as info:
        plan_submodule(holder or Holder(), sub, path)
    return str(info.value)


def test_source_that_fits_is_planned(tiny_hf: Path) -> None:
    plan = plan_submodule(Holder(), "model", tiny_hf)
    assert plan.keys["layers.0.attention.wq.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert plan.keys["output.weight"] == "model.embed_tokens.weight"  # tied: the file holds one


def test_missing_path(tmp_path: Path) -> None:
    assert "does not exist" in _error(tmp_path, tmp_path / "nowhere")


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("x")
    assert "no .safetensors files" in _error(tmp_path, tmp_path) and "README.md" in _error(tmp_path, tmp_path)


def test_index_lists_a_shard_that_is_not_there(tmp_path: Path, tiny_hf: Path) -> None:
    import shutil

    shutil.copytree(tiny_hf, tmp_path / "m")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00001-of-00002.safetensors" in _error(tmp_path, tmp_path / "m")


def _rewrite(tiny_hf: Path, out: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    state = change(load_file(tiny_hf / "model.safetensors"))
    out.mkdir()
    save_file(state, out / "model.safetensors")
    return out


def test_missing_and_unexpected_names_with_closest_matches(tmp_path: Path, tiny_hf: Path) -> None:
    def rename(state):
        state["model.layers.0.self_attn.q_proj.weight_renamed"] = state.pop("model.layers.0.self_attn.q_proj.weight")
        return state

    message = _error(tmp_path, _rewrite(tiny_hf, tmp_path / "m", rename))
    assert "missing 'model.layers.0.self_attn.q_proj.weight'" in message, message
    assert "closest in the file: 'model.layers.0.self_attn.q_proj.weight_renamed'" in message, message
    assert "unexpected 'model.layers.0.self_attn.q_proj.weight_renamed'" in message, message
    assert "nothing was loaded" in message


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path: Path, tiny_hf: Path) -> None:
    def cut(state):
        state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:48]
        return state

    message = _error(tmp_path, _rewrite(tiny_hf, tmp_path / "m", cut))
    assert "model.layers.1.mlp.up_proj.weight" in message and "[48, 64]" in message and "[96, 64]" in message


def test_unsupported_dtype(tmp_path: Path, tiny_hf: Path) -> None:
    def quantize(state):
        state["model.norm.weight"] = state["model.norm.weight"].to(torch.float8_e4m3fn)
        return state

    message = _error(tmp_path, _rewrite(tiny_hf, tmp_path / "m", quantize))
    assert "dtype of 'model.norm.weight': F8_E4M3" in message and "dequantize" in message, message


def test_config_json_of_another_model(tmp_path: Path, tiny_hf: Path) -> None:
    import shutil

    shutil.copytree(tiny_hf, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["rope_theta"] = 10000.0
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    message = _error(tmp_path, tmp_path / "m")
    assert "config.json: rope_theta: 10000.0 there, 500000.0 here" in message, message


def test_unknown_submodule(tiny_hf: Path, tmp_path: Path) -> None:
    message = _error(tmp_path, tiny_hf, sub="backbone")
    assert "has no submodule 'backbone'" in message and "['model']" in message


def test_bf16_file_is_accepted_and_cast(tmp_path: Path, tiny_hf: Path) -> None:
    src = _rewrite(tiny_hf, tmp_path / "m", lambda s: {k: v.to(torch.bfloat16) for k, v in s.items()})
    plan_submodule(Holder(), "model", src)  # no error: cast to the fp32 parameters when read


@pytest.mark.parametrize("family", ["hf_qwen3_moe", "hf_mixtral"])
def test_experts_saved_one_by_one_fill_the_packed_parameters(family: str, tmp_path: Path) -> None:
    """transformers saves packed experts one expert at a time (Qwen3-MoE ``mlp.experts.{e}.gate_proj``/``up_proj``/
    ``down_proj``, Mixtral ``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``), as the Hub's files hold them: planned
    and loaded into a model built on meta, every tensor equals what transformers' own loader builds."""
    import lightning as L
    from transformers import AutoModelForCausalLM

    from cuboid.checkpoint import pretrained as loader

    torch.manual_seed(PRETRAINED_SEED)
    third_party.build_model(family).save_pretrained(tmp_path)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.model = third_party.build_model(family)

    lm = Module()
    lm.model.to_empty(device="cpu")
    plan = loader.plan_submodule(lm, "model", tmp_path)
    assert set(plan.source.packed) == {f"model.layers.{i}.mlp.experts.{p}" for i in range(4)
                                       for p in ("gate_up_proj", "down_proj")}  # fmt: skip
    loader.load(lm, plan)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    ours = lm.model.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], v) for k, v in theirs.items())


def test_a_region_of_packed_experts_reads_only_its_experts() -> None:
    """What one rank of an expert-parallel layout asks for (experts 2 and 3 of 4, half the columns): experts 0
    and 1 are never read (they sit on the meta device here, where any read would fail)."""
    from cuboid.checkpoint.packed import PackedExperts, per_expert_keys

    gate = [torch.randn(3, 4) for _ in range(4)]
    up = [torch.randn(3, 4) for _ in range(4)]
    parts = [[g.to("meta"), u.to("meta")] if e < 2 else [g, u] for e, (g, u) in enumerate(zip(gate, up, strict=True))]
    packed = PackedExperts(parts)
    assert packed.size() == (4, 6, 4)
    region = packed.region([2, 0, 2], [2, 6, 2])
    want = torch.stack([torch.cat([gate[e], up[e]])[:, 2:4] for e in (2, 3)])
    assert torch.equal(region, want)
    keys = {f"m.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(2) for w in ("w1", "w2", "w3")}
    assert per_expert_keys("m.layers.0.mlp.experts.gate_up_proj", 2, keys) == [
        [f"m.layers.0.block_sparse_moe.experts.{e}.w1.weight", f"m.layers.0.block_sparse_moe.experts.{e}.w3.weight"]
        for e in range(2)
    ]
    assert per_expert_keys("m.layers.0.mlp.experts.gate_up_proj", 3, keys) is None  # expert 2 is not there
