"""The standalone packages' door: a project written against ``pytorch_lightning`` and ``lightning_fabric``.

The parity worker and the Fabric loop run rewritten to those packages (``workers/as_pytorch_lightning.py``: the
same rewrite :mod:`cuboid.packages` builds ``cuboid.pytorch_lightning`` with), so each run is a
``pytorch_lightning.Trainer`` or a ``lightning_fabric.Fabric`` with Cuboid's strategy for that package. A pooled
subset of the parity, checkpoint-reshard and Fabric tests: the same references and the same bound (1e-5), never
loosened. A checkpoint written under ``pytorch_lightning`` resumes on another layout under either package.
"""

from __future__ import annotations

import pytest
import third_party
from ahead import ahead
from harness import WORKERS, SpecRuns
from parity_lib import LOSS_RTOL, PARAM_ATOL, parity_errors, reference_run

SHIM = WORKERS / "as_pytorch_lightning.py"
PP = {"pipeline_parallel": 2}
# name -> (processes, spec of the parity worker, accumulate_grad_batches)
PARITY = {
    "pl-dp2": (2, {"strategy": {}}, 1),
    "pl-tp2": (2, {"strategy": {"tensor_parallel": 2}}, 1),
    "pl-pp2-1F1B": (2, {"strategy": PP}, 1),
    "pl-dp2xtp2": (4, {"strategy": {"tensor_parallel": 2}}, 1),
    "pl-hsdp2x2-accum4": (4, {"strategy": {"data_parallel_replicate": 2}, "ledger": "per_step"}, 4),
    "pl-hsdp2x2-accum4-every": (
        4,
        {"strategy": {"data_parallel_replicate": 2, "defer_reductions": None}, "ledger": "per_step"},
        4,
    ),
    "pl-pp2xdp2-1F1B-accum2": (4, {"strategy": PP}, 2),
}
FABRIC_CLIP = 1.75  # tests/fabric/test_fabric.py's for the Llama: clipped on some steps
FABRIC_STEPS = 6


@pytest.fixture(scope="module")
@ahead
def results(tmp_path_factory: pytest.TempPathFactory) -> SpecRuns:
    out = tmp_path_factory.mktemp("pytorch_lightning")
    saved = out / "dp2xtp2" / "step=6.ckpt"
    got = SpecRuns(out)
    for world in (4, 2):
        specs = [{"name": name, "accumulate": acc, **spec} for name, (w, spec, acc) in PARITY.items() if w == world]
        if world == 4:  # the checkpoint the others resume: dp2 x tp2, saved at step 6 of 7
            specs.append({"name": "pl-dp2xtp2-save", "strategy": {"tensor_parallel": 2}, "max_steps": 7,
                          "save_every": 6, "save_dir": str(out / "dp2xtp2")})  # fmt: skip
        got.launch(world, SHIM, specs, before=(str(WORKERS / "parity_worker.py"),))
    got.launch(2, SHIM, [{"name": "pl-dp2-from-dp2xtp2", "strategy": {}, "resume_from": str(saved)}],
               before=(str(WORKERS / "parity_worker.py"),))  # fmt: skip
    # the same checkpoint under the unified package, on one process
    got.launch(
        1, WORKERS / "parity_worker.py", [{"name": "lightning-from-pl", "strategy": {}, "resume_from": str(saved)}]
    )
    fabric = {"name": "fabric-dp2-registered", "steps": FABRIC_STEPS, "clip": FABRIC_CLIP, "registered": True}
    got.launch(2, SHIM, [fabric], before=(str(WORKERS / "fabric_worker.py"),))
    return got


def ran_standalone(got: dict) -> None:
    trainer, strategy = got["classes"]
    assert trainer.startswith(("pytorch_lightning.", "lightning_fabric.")), got["classes"]
    assert strategy.startswith("cuboid.pytorch_lightning."), got["classes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_a_pytorch_lightning_trainer_matches_one_process(name: str, results) -> None:
    got, acc = results[name], PARITY[name][2]
    ran_standalone(got)
    rel, err = parity_errors(got, reference_run(acc))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (name, rel, err)


@pytest.mark.slow
def test_hsdp_accumulation_under_pytorch_lightning_all_reduces_once_per_optimizer_step(results) -> None:
    """The deferral hangs on the strategy's ``block_backward_sync``, which ``pytorch_lightning``'s loop enters as
    Lightning's does: at accumulate 4, a quarter of the all-reduces across replicas of reducing at every batch."""
    deferred, every = results["pl-hsdp2x2-accum4"], results["pl-hsdp2x2-accum4-every"]
    for mine, theirs in zip(deferred["ranks"], every["ranks"], strict=True):
        counts = [step["dp_replicate"]["all_reduce"][0] for step in mine["ledger_tables"]]
        before = [step["dp_replicate"]["all_reduce"][0] for step in theirs["ledger_tables"]]
        assert len(counts) == 3 and all(c >= 1 and 4 * c == b for c, b in zip(counts, before, strict=True)), (
            counts,
            before,
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pl-dp2-from-dp2xtp2", "lightning-from-pl"])
def test_a_pytorch_lightning_checkpoint_resumes_on_another_layout_under_either_package(name: str, results) -> None:
    """Saved at step 6 by a ``pytorch_lightning`` Trainer at dp2 x tp2; resumed at dp2 under the same package and
    on one process under ``lightning``: steps 7-12 of the one-process reference."""
    got = results[name]
    if name.startswith("pl-"):
        ran_standalone(got)
    else:
        assert got["classes"][0].startswith("lightning.pytorch."), got["classes"]
    rel, err = parity_errors(got, reference_run(1), steps=slice(6, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (name, rel, err)


@pytest.mark.slow
def test_a_lightning_fabric_loop_with_the_registered_name_matches_one_process(results) -> None:
    """``lightning_fabric.Fabric(strategy="cuboid")``: its registry's entry builds Cuboid's Fabric strategy for
    that package; the litgpt-style loop on the transformers Llama matches one process."""
    got = results["fabric-dp2-registered"]
    ran_standalone(got)
    ref = third_party.reference_run("hf_llama", steps=FABRIC_STEPS, max_norm=FABRIC_CLIP)
    rel, err = parity_errors(got, ref)
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)
