"""The fast subset that `.ci/run` also runs against the floor versions declared in pyproject.toml.

One parity run per dimension (FSDP2 dp2, tensor parallel tp2, pipeline parallel pp2, context parallel cp2 on
64-token sequences, expert parallel ep2 on Cuboid's MoE) and one checkpoint reshard (saved at tp2, resumed at dp2),
with the bound of test_parity, all in one 2-process launch. In the main environment this repeats what test_parity,
test_context_parallel, test_expert_parallel and test_checkpoint cover (it is the quick tier's launch); in the floor
environment it is what keeps the declared floors true.
"""

from __future__ import annotations

import json

import pytest
import torch
from harness import WORKERS, SpecRuns
from parity_lib import LOSS_RTOL, MOE_CFG, PARAM_ATOL, parity_errors, reference_run

STEPS = 6  # the cp and ep runs stop after 6 of the epoch's 12 steps, as their own modules' runs do
RUNS = {
    "floor-dp2": {"strategy": {}},
    "floor-tp2": {"strategy": {"tensor_parallel": 2}},
    "floor-pp2": {"strategy": {"pipeline_parallel": 2}},
    # max grad norms at which the reference clips on some of the 6 steps and not on others (as in their modules)
    "floor-cp2": {"strategy": {"context_parallel": 2}, "seq": 64, "clip": 1.3, "max_steps": STEPS},
    "floor-ep2": {"strategy": {"expert_parallel": 2}, "model": "cuboid_moe", "clip": 1.4, "max_steps": STEPS},
}


def reference(name: str):
    """The single-process run ``name`` must match: the default parity reference, or the cp run's longer sequences,
    or the MoE's (its load-balancing loss over the global batch), each clipped where its run clips."""
    spec = RUNS.get(name, {})
    if "seq" in spec:
        return reference_run(seq=spec["seq"], steps=STEPS, clip=spec["clip"])
    if spec.get("model") == "cuboid_moe":
        return reference_run(steps=STEPS, clip=spec["clip"], cfg=MOE_CFG)
    return reference_run()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("floor")
    specs = [{"name": name, **spec} for name, spec in RUNS.items()]
    specs.append(
        {"name": "floor-save-tp2", "strategy": {"tensor_parallel": 2}, "max_steps": 7, "save_every": 6,
         "save_dir": str(out / "tp2")}
    )  # fmt: skip
    specs.append({"name": "floor-tp2-to-dp2", "strategy": {}, "resume_from": str(out / "tp2" / "step=6.ckpt")})
    got = SpecRuns(out)
    got.launch(2, WORKERS / "parity_worker.py", specs)
    return got


@pytest.mark.slow
@pytest.mark.quick  # the quick tier's multi-process launch: dp2, tp2, pp2, cp2, ep2 and a checkpoint reshard
@pytest.mark.parametrize("name", [*RUNS, "floor-tp2-to-dp2"])
def test_floor_subset_matches_single_process(name: str, results) -> None:
    import lightning

    ref = reference(name)
    if "clip" in RUNS.get(name, {}):  # clipping is exercised, both ways
        clipped = [n > RUNS[name]["clip"] for n in ref.grad_norms]
        assert any(clipped) and not all(clipped), (name, ref.grad_norms)
    rel, err = parity_errors(results[name], ref, slice(6, None) if name.endswith("to-dp2") else slice(None))
    print(f"{name} (torch {torch.__version__}, lightning {lightning.__version__}): {rel:.2e} / {err:.2e}")
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_floor_main_job_runs_with_hydra_and_wandb(tmp_path) -> None:
    """The main job (Hydra's composition, ``pkg://cuboid.conf``, W&B's offline run) at the installed versions: in
    the floor job, hydra-core's and wandb's floors."""
    import sys

    import hydra
    import wandb
    from harness import run_checked, worker_env

    overrides = ["trainer.max_steps=10", "trainer.val_check_interval=5", f"data.cache_dir={tmp_path / 'cache'}"]
    out = run_checked([sys.executable, "-m", "cuboid.train", *overrides], timeout=300, env=worker_env(), cwd=tmp_path)
    (summary,) = tmp_path.glob("outputs/*/*/summary.json")
    result = json.loads(summary.read_text())
    print(f"main job (hydra-core {hydra.__version__}, wandb {wandb.__version__}): {result['steps']} steps")
    assert result["steps"] == 10 and result["val_loss"] == result["val_loss"]  # validated (not NaN)
    assert list(summary.parent.glob("wandb/offline-run-*")), out[-2000:]
