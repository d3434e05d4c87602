"""LoRA fine-tuning with PEFT (code nobody here wrote): ``peft.get_peft_model`` on a tiny transformers Llama inside
the suite's HFModule (the optimizer over the trainable parameters, as LoRA users write it), under Cuboid.

Against one process (fp32, AdamW, clipping on some steps, the parity bound 1e-5): FSDP (dp2), tp2, dp2 x tp2
and HSDP 2 x 2, and on meta with the base read from ``pretrained=`` at dp2 x tp2. The frozen base is bit-identical
after training, only the adapter has optimizer state, a checkpoint holds the adapter (not the base) and resumes at
another layout, and ``python -m cuboid.export --peft`` writes a directory ``PeftModel.from_pretrained`` loads, whose
logits equal the trained model's.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator

import pytest
import third_party
import torch
from harness import WORKERS, python, torchrun
from parity_lib import LOSS_RTOL, PARAM_ATOL, parity_errors

pytest.importorskip("peft")  # the suite installs cuboid[peft]; outside it, these are skipped

FAMILY = "hf_llama_lora"
STEPS = 6
TABLE: dict[str, tuple[float, float]] = {}
TP2 = {"tensor_parallel": 2}
RUNS = {  # name: (world, strategy)
    "dp2": (2, {}),
    "tp2": (2, TP2),
    "dp2xtp2": (4, TP2),
    "hsdp2x2": (4, {"data_parallel_replicate": 2, "data_parallel_shard": 2}),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    out = tmp_path_factory.mktemp("lora")
    base = out / "base"  # the "pretrained" model a fine-tune starts from: the reference's base weights
    third_party.initial_model("hf_llama").save_pretrained(base)
    ckpts = out / "ckpt"
    four = [{"name": n, "strategy": s} for n, (w, s) in RUNS.items() if w == 4]
    four[0]["save_dir"] = str(ckpts)  # dp2 x tp2 saves at steps 3 and 6
    four.append({"name": "dp2xtp2-meta-pretrained", "meta_init": True,
                 "strategy": {**TP2, "pretrained": {"model": str(base)}}})  # fmt: skip
    torchrun(4, WORKERS / "lora_worker.py", str(out), json.dumps(four))
    two = [{"name": n, "strategy": s} for n, (w, s) in RUNS.items() if w == 2]
    two.append({"name": "tp2-from-dp2xtp2", "strategy": TP2, "resume_from": str(ckpts / "step=3.ckpt")})
    torchrun(2, WORKERS / "lora_worker.py", str(out), json.dumps(two))
    got = {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}
    got["out"], got["base"], got["ckpts"] = out, base, ckpts
    yield got
    print("\nLoRA parity (max relative loss error, max absolute parameter error):")
    for name, (rel, err) in TABLE.items():
        print(f"  {name:28s} {rel:.1e} {err:.1e}")


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.{n}": p for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_a_lora_fine_tune_matches_one_process(name: str, results) -> None:
    ref = third_party.reference_run(FAMILY, steps=STEPS)
    clipped = [n > third_party.CLIP[FAMILY] for n in ref.grad_norms]
    assert any(clipped) and not all(clipped), ref.grad_norms
    got = results[name]
    rel, err = TABLE[name] = parity_errors(got, ref)
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (name, got["layout"], rel, err)
    initial = third_party.initial_model(FAMILY)
    frozen = _frozen(initial)
    adapters = {f"model.{n}" for n, p in initial.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    # the base stays exactly as it was: bit-identical, not merely within the bound
    changed = [n for n, p in frozen.items() if not torch.equal(got["params"][n], p)]
    assert not changed, changed[:3]
    assert set(got["trainable"]) == adapters
    assert set(got["optimized"]) == adapters  # AdamW state for the adapter only
    # and the adapters did train: every B left zero
    assert all(got["params"][n].abs().max() > 0 for n in adapters if ".lora_B." in n)
    if "tp2" in name:  # the base split by the model's own plan, each LoRA matrix beside it as PEFT splits it
        q = "model.base_model.model.model.layers.0.self_attn.q_proj"
        o = "model.base_model.model.model.layers.0.self_attn.o_proj"
        place = got["placements"]
        assert place[f"{q}.base_layer.weight"][-1] == "S(0)" and place[f"{q}.lora_B.default.weight"][-1] == "S(0)"
        assert place[f"{o}.base_layer.weight"][-1] == "S(1)" and place[f"{o}.lora_A.default.weight"][-1] == "S(1)"
        assert "S(1)" not in place[f"{q}.lora_A.default.weight"] and len(place[f"{o}.lora_B.default.weight"]) == 1


@pytest.mark.slow
def test_a_lora_model_built_on_meta_reads_its_base_from_pretrained(results) -> None:
    """``get_peft_model`` on a meta model, ``pretrained={"model": <the base's transformers directory>}``: the base
    is the file's (and stays it), the adapters get PEFT's own init (A as ``nn.Linear``, B zero), and training from
    there matches one process from the same start."""
    got = results["dp2xtp2-meta-pretrained"]
    file = third_party.initial_model("hf_llama")
    for name, tensor in got["initial"].items():
        if ".lora_" in name:
            continue
        own = name.removeprefix("model.base_model.model.").replace(".base_layer", "")
        assert torch.equal(tensor, file.get_parameter(own)), name
        assert torch.equal(got["params"][name], tensor), name  # and after training, bit-identical
    lora_a = [t for n, t in got["initial"].items() if ".lora_A." in n]
    lora_b = [t for n, t in got["initial"].items() if ".lora_B." in n]
    assert lora_a and all(t.count_nonzero() == 0 for t in lora_b)
    for a in lora_a:  # kaiming_uniform(a=sqrt(5)): uniform within 1/sqrt(fan_in), not transformers' N(0, 0.02)
        bound = 1 / math.sqrt(a.shape[1])
        assert a.abs().max() <= bound and a.std() > 0.5 * bound / math.sqrt(3), (a.abs().max(), a.std())
    start = {k.removeprefix("model."): v for k, v in got["initial"].items()}
    ref = third_party.reference_run(FAMILY, steps=STEPS, initial=start)
    rel, err = TABLE["dp2xtp2-meta-pretrained"] = parity_errors(got, ref)
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_an_adapter_checkpoint_holds_the_adapter_and_resumes_at_another_layout(results) -> None:
    """dp2 x tp2's checkpoint at step 3 holds the adapter and its AdamW state, not the frozen base (which comes
    back from where it came: the module's construction, or ``pretrained=``); tp2 resumes it and steps 4-6 equal
    6 uninterrupted steps on one process."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(results["ckpts"] / "step=3.ckpt").read_metadata().state_dict_metadata
    stored = {k[len("model.") :] for k in keys if k.startswith("model.")}
    adapters = set(results["dp2xtp2"]["trainable"])
    assert stored == adapters, sorted(stored ^ adapters)[:4]
    state = {k[len("optimizer_0.state.") :].rsplit(".", 1)[0] for k in keys if k.startswith("optimizer_0.state.")}
    assert state == adapters, sorted(state ^ adapters)[:4]  # AdamW's state: the adapter's only
    ref = third_party.reference_run(FAMILY, steps=STEPS)
    got = results["tp2-from-dp2xtp2"]
    rel, err = TABLE["tp2-from-dp2xtp2"] = parity_errors(got, ref, slice(3, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_the_exported_adapter_loads_in_peft_with_the_same_logits(results) -> None:
    """``python -m cuboid.export CKPT OUT --peft`` on dp2 x tp2's last checkpoint; ``PeftModel.from_pretrained`` on
    the base model gives logits within 1e-5 of the ones the sharded model computed after training."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(WORKERS))
    from lora_worker import probe_batch

    out = results["out"] / "adapter"
    done = python([sys.executable, "-m", "cuboid.export", str(results["ckpts"] / "step=6.ckpt"), str(out), "--peft"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(results["base"]), out).eval()
    with torch.no_grad():
        logits = model(input_ids=probe_batch()).logits
    cuboid = results["dp2xtp2"]["logits"]
    assert (logits - cuboid).abs().max() <= 1e-5 * cuboid.abs().max(), (logits - cuboid).abs().max()
    # not trivially so: the base alone gives other logits
    with torch.no_grad(), model.disable_adapter():
        plain = model(input_ids=probe_batch()).logits
    assert (plain - cuboid).abs().max() > 1e-3
