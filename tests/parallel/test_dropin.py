"""Cuboid as a drop-in for Lightning's own strategies, tried as a user coming from them would.

- A LightningModule written for ModelParallelStrategy (its configure_model parallelizes by hand with
  ``self.device_mesh["tensor_parallel"]`` and ``["data_parallel"]``) runs unchanged under Cuboid.
- Checkpoints go both ways: plain DDP -> Cuboid (tp2, pp2), ModelParallelStrategy full file and DCP
  directory -> Cuboid, and Cuboid's ``checkpoint_format="full"`` -> plain DDP, optimizer included; also
  with transformers' Qwen3. Every run is saved at the end of epoch 1 and resumed into epoch 2, which must
  follow the single-process curve with the parity bound (weights *and* AdamW state carried over).
"""

from __future__ import annotations

import pytest
import torch
from ahead import ahead
from harness import WORKERS, SpecRuns
from parity_lib import (
    ADAMW,
    CFG,
    CLIP,
    LOSS_RTOL,
    PARAM_ATOL,
    SEED,
    TokenDataset,
    lm_loss,
    parity_errors,
    reference_run,
)

from cuboid.models import Llama

third_party = pytest.importorskip("third_party")

TP2, PP2 = {"tensor_parallel": 2}, {"pipeline_parallel": 2}

# name -> (spec, reference family, which steps of the 2-epoch reference it must follow)
FIRST, SECOND = slice(0, 12), slice(12, 24)


def _specs(out) -> list[dict]:
    def save(name, strategy, kwargs=None, module="llama"):
        path = str(out / f"{name}.ckpt")
        return {"name": name, "strategy": strategy, "kwargs": kwargs or {}, "module": module, "save_after_fit": path}

    def resume(name, source, kwargs, strategy="cuboid", module="llama"):
        spec = {"name": name, "strategy": strategy, "kwargs": kwargs, "module": module, "epochs": 2}
        return {**spec, "resume_from": str(out / f"{source}.ckpt")}

    return [
        # the same hand-parallelized module under ModelParallelStrategy and Cuboid
        # (unclipped: ModelParallelStrategy's clip_grad_norm_ fails when TP and non-TP parameters sit on
        # different meshes, "All operands in aten.stack.default must have the same mesh")
        {"name": "model_parallel-by_hand-tp2", "strategy": "model_parallel", "kwargs": {"tensor_parallel_size": 2},
         "module": "by_hand", "clip": False},
        {"name": "cuboid-by_hand-tp2", "strategy": "cuboid", "kwargs": TP2, "module": "by_hand", "clip": False},
        {"name": "cuboid-by_hand-dp2", "strategy": "cuboid", "kwargs": {}, "module": "by_hand", "clip": False},
        # DDP -> Cuboid
        save("ddp", "ddp"),
        resume("cuboid-tp2-from-ddp", "ddp", TP2),
        resume("cuboid-pp2-from-ddp", "ddp", PP2),
        # Cuboid full file -> DDP (pipeline stages: the optimizer's positions follow the whole model)
        save("cuboid-pp2-full", "cuboid", {**PP2, "checkpoint_format": "full"}),
        resume("ddp-from-cuboid-pp2-full", "cuboid-pp2-full", {}, strategy="ddp"),
        # ModelParallelStrategy full file and DCP directory -> Cuboid
        save("model_parallel-full", "model_parallel", {"save_distributed_checkpoint": False}, "by_hand"),
        resume("cuboid-pp2-from-model_parallel-full", "model_parallel-full", PP2),
        save("model_parallel-dcp", "model_parallel", {}, "by_hand"),
        resume("cuboid-tp2-from-model_parallel-dcp", "model_parallel-dcp", TP2),
        # a third-party model, both ways
        save("ddp-qwen3", "ddp", module="hf_qwen3"),
        resume("cuboid-tp2-qwen3-from-ddp", "ddp-qwen3", TP2, module="hf_qwen3"),
        save("cuboid-tp2-qwen3-full", "cuboid", {**TP2, "checkpoint_format": "full"}, "hf_qwen3"),
        resume("ddp-qwen3-from-cuboid-full", "cuboid-tp2-qwen3-full", {}, strategy="ddp", module="hf_qwen3"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
@ahead
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("dropin")
    specs = _specs(out)
    got = SpecRuns(out)
    got.launch(2, WORKERS / "dropin_worker.py", specs)
    return got


@pytest.fixture(scope="module")
def references() -> dict[str, object]:
    return {"llama": reference_run(epochs=2), "hf_qwen3": third_party.reference_run("hf_qwen3", epochs=2)}


def _check(got: dict, ref, steps: slice) -> tuple[float, float]:
    rel, err = parity_errors(got, ref, steps)
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)
    return rel, err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model_parallel-by_hand-tp2", "cuboid-by_hand-tp2", "cuboid-by_hand-dp2"])
def test_a_module_written_for_model_parallel_runs_unchanged(name: str, results) -> None:
    """Its configure_model asks for the mesh by ModelParallelStrategy's names; Cuboid's mesh answers to them."""
    got = results[name]
    assert got["strategy"] == ("ModelParallelStrategy" if name.startswith("model_parallel") else "CuboidStrategy")
    _check(got, reference_run(clip=None), FIRST)
    assert got["losses"] == pytest.approx(results["model_parallel-by_hand-tp2"]["losses"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "cuboid-tp2-from-ddp",
        "cuboid-pp2-from-ddp",
        "ddp-from-cuboid-pp2-full",
        "cuboid-pp2-from-model_parallel-full",
        "cuboid-tp2-from-model_parallel-dcp",
        "cuboid-tp2-qwen3-from-ddp",
        "ddp-qwen3-from-cuboid-full",
    ],
)
def test_checkpoints_trade_with_lightning_strategies(name: str, results, references) -> None:
    """Resumed into epoch 2 on the single-process curve: weights and optimizer state came across."""
    family = "hf_qwen3" if "qwen3" in name else "llama"
    rel, err = _check(results[name], references[family], SECOND)
    print(f"{name}: max rel loss err {rel:.2e}, max abs param err {err:.2e}")


@pytest.mark.slow
def test_without_the_optimizer_state_the_curve_would_differ(results, references) -> None:
    """The resume checks can fail: epoch 2 from epoch 1's weights with a *fresh* AdamW leaves the bound at once."""
    ref = references["llama"]
    assert results["ddp"]["losses"] == pytest.approx(ref.losses[FIRST], rel=1e-5)
    model = Llama(CFG)
    model.load_state_dict({k[len("model.") :]: v for k, v in results["ddp"]["params"].items()})
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    data = TokenDataset()
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + 1)).tolist()
    for k in range(2):
        tokens = torch.stack([data[i]["tokens"] for i in perm[8 * k : 8 * (k + 1)]])
        loss = lm_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP[1])
        opt.step()
        opt.zero_grad()
    tokens = torch.stack([data[i]["tokens"] for i in perm[16:24]])
    fresh = lm_loss(model(tokens[:, :-1]), tokens).item()
    assert abs(fresh - ref.losses[14]) / ref.losses[14] > 100 * LOSS_RTOL, (fresh, ref.losses[14])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("cuboid-tp2-from-ddp", "ddp"),
        ("cuboid-pp2-from-ddp", "ddp"),
        ("cuboid-pp2-from-model_parallel-full", "model_parallel-full"),
        ("cuboid-tp2-qwen3-from-ddp", "ddp-qwen3"),
    ],
)
def test_resumed_state_is_exactly_what_the_lightning_file_holds(name: str, source: str, results, tmp_path_factory):
    """Right after loading, every weight and every AdamW tensor equals the file's, bit for bit (positions mapped to
    names by the optimizer's groups; under pp2 each rank held half of them)."""
    path = next(tmp_path_factory.getbasetemp().glob(f"dropin*/{source}.ckpt"))
    saved = torch.load(path, map_location="cpu", weights_only=False)
    loaded = results[name]["loaded"]
    names = [n for n in saved["state_dict"] if n in results[name]["params"]]
    assert names == list(results[name]["params"])  # the model's parameters, in the model's order
    for n in names:
        assert torch.equal(loaded[n], saved["state_dict"][n]), n
    osd = saved["optimizer_states"][0]
    assert [g["params"] for g in osd["param_groups"]] == [list(range(len(names)))]
    checked = 0
    for pos, entry in osd["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded[f"state.{names[pos]}.{key}"], value), (names[pos], key)
            checked += 1
    assert checked == 3 * len(names)  # step, exp_avg, exp_avg_sq of every parameter
