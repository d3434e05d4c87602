"""Lightning's own callbacks under Cuboid: the decisions they take and the checkpoints they write.

- ``ModelCheckpoint(monitor=..., save_top_k=2)`` and ``EarlyStopping`` agree over every rank: under tp2 and
  pp2 they keep the same checkpoints and stop at the same step as a single-process run (Lightning's
  ``reduce_boolean_decision`` compared a dp-group sum with the world size, so top-k never updated under tp).
- A checkpoint from the end of an epoch (``ModelCheckpoint``'s default save, or ``trainer.save_checkpoint``
  after ``fit``) resumes with the whole next epoch, in both formats; it had skipped the epoch's batches again.
"""

from __future__ import annotations

import pytest
import torch
from ahead import ahead
from harness import WORKERS, SpecRuns
from parity_lib import LOSS_RTOL, PARAM_ATOL, parity_errors, reference_run

TP2, PP2 = {"tensor_parallel": 2}, {"pipeline_parallel": 2}
LAYOUTS = {"single": (1, {}), "tp2": (2, TP2), "pp2": (2, PP2)}
# Stops after the epoch whose last logged train_loss falls below 5.2: epoch 3 of 4 on the reference curve.
EARLY = {"monitor": "train_loss", "stopping_threshold": 5.2, "check_on_train_epoch_end": True}
FORMATS = ("sharded", "full")


@pytest.fixture(scope="module")
@ahead
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("callbacks")
    launches: dict[int, list[dict]] = {1: [], 2: []}
    for layout, (world, strategy) in LAYOUTS.items():
        launches[world].append(
            {
                "name": f"decide-{layout}",
                "strategy": strategy,
                "epochs": 4,
                "save_every": 2,
                "save_dir": str(out / f"decide-{layout}"),
                "top_k": 2,
                "monitor": "train_loss",
                "early_stopping": EARLY,
            }
        )
    for fmt in FORMATS:
        strategy = {"checkpoint_format": fmt}
        launches[2].append(
            {
                "name": f"epoch-end-{fmt}",
                "strategy": strategy,
                "save_epoch_end": str(out / f"epoch-end-{fmt}"),
                "save_after_fit": str(out / f"after-fit-{fmt}.ckpt"),
            }
        )
        for path in (f"epoch-end-{fmt}/epoch=0-step=12.ckpt", f"after-fit-{fmt}.ckpt"):
            name = f"resume-{path.split('/')[0].replace('.ckpt', '')}"
            launches[2].append({"name": name, "strategy": {}, "epochs": 2, "resume_from": str(out / path)})
    # a fit stopped by max_steps in the middle of epoch 0: Lightning counts that epoch as done and resumes with
    # epoch 1 from its first batch (Cuboid had skipped 6 batches of epoch 1)
    launches[2].append({"name": "stopped-at-step-6", "strategy": {}, "max_steps": 6,
                        "save_after_fit": str(out / "stopped.ckpt")})  # fmt: skip
    launches[2].append(
        {"name": "resume-stopped", "strategy": {}, "epochs": 2, "resume_from": str(out / "stopped.ckpt")}
    )
    # and a third-party model: transformers' Qwen3 at tp2, saved at the epoch's end, resumed at dp2
    launches[2].append(
        {"name": "epoch-end-qwen3", "model": "hf_qwen3", "strategy": TP2, "save_epoch_end": str(out / "qwen3")}
    )
    launches[2].append(
        {"name": "resume-epoch-end-qwen3", "model": "hf_qwen3", "strategy": {}, "epochs": 2,
         "resume_from": str(out / "qwen3" / "epoch=0-step=12.ckpt")}
    )  # fmt: skip
    got = SpecRuns(out)
    for world, specs in launches.items():
        got.launch(world, WORKERS / "parity_worker.py", specs)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_top_k_and_early_stopping_decide_as_single_process(layout: str, results) -> None:
    single, got = results["decide-single"]["ranks"][0], results[f"decide-{layout}"]["ranks"]
    assert single["stopped_at"] == 36  # the reference stops after epoch 3 of 4
    assert len(single["kept"]) == 2 and single["best"] in single["kept"]
    for facts in got:  # every rank: same stopping step, same checkpoints kept, same best
        assert facts["stopped_at"] == single["stopped_at"], (facts["rank"], facts["stopped_at"])
        assert facts["kept"] == single["kept"], (facts["rank"], facts["kept"], single["kept"])
        assert facts["best"] == single["best"], (facts["rank"], facts["best"], single["best"])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ["epoch-end", "after-fit"])
def test_end_of_epoch_checkpoint_resumes_with_the_next_epoch(fmt: str, path: str, results) -> None:
    """fit one epoch, save at its end, resume with max_epochs=2: the whole second epoch is trained, on the
    single-process curve."""
    ref = reference_run(epochs=2)
    got = results[f"resume-{path}-{fmt}"]
    assert len(got["losses"]) == 12, len(got["losses"])  # it trained 0 steps before
    rel, err = parity_errors(got, ref, slice(12, 24))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)
    # and it saw the second epoch's samples, every one of them
    seen = {i for facts in got["ranks"] for step in facts["seen"] for i in step}
    assert seen == set(range(96))


@pytest.mark.slow
def test_end_of_epoch_resume_of_a_third_party_model(results) -> None:
    third_party = pytest.importorskip("third_party")
    ref = third_party.reference_run("hf_qwen3", epochs=2)
    got = results["resume-epoch-end-qwen3"]
    assert len(got["losses"]) == 12, len(got["losses"])
    rel, err = parity_errors(got, ref, slice(12, 24))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_a_fit_stopped_by_max_steps_resumes_with_the_next_epoch_from_its_start(results) -> None:
    """Lightning resumes a checkpoint saved after max_steps stopped fit mid-epoch with the next epoch; the data
    follows it: epoch 1's 12 batches, from its first (the global batches of the epoch-1 permutation, in order)."""
    from parity_lib import GLOBAL_BATCH, SEED

    got = results["resume-stopped"]
    assert len(got["losses"]) == 12, len(got["losses"])
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(SEED + 1)).tolist()
    for step in range(12):
        seen = {i for facts in got["ranks"] for i in facts["seen"][step]}
        assert seen == set(perm[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]), step
