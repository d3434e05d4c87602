"""Ray Train (issue 68, item 3): ``TorchTrainer`` workers on a Ray started on loopback, each building
``L.Trainer(strategy=RayCuboidStrategy(...), plugins=[RayLightningEnvironment()], devices="auto")`` and calling
``prepare_trainer``, as Ray's Lightning guide does (tests/workers/ray_job.py); the same loop under torchrun as the
reference. One Ray session runs four jobs:

- ``killed``: 2 workers (dp2), 2 epochs, a checkpoint reported to Ray each epoch; rank 1 kills itself (SIGKILL) at
  step 6, Ray's ``FailureConfig(max_failures=1)`` restarts the group, which resumes from
  ``ray.train.get_checkpoint()`` (step 4);
- ``resume_tp2``: the same Ray run started again at 4 workers, tp2 (dp2 x tp2), for a third epoch: it resumes the
  run's latest checkpoint, resharded;
- ``tp2``: 4 workers at dp2 x tp2 from the start, one epoch;
- ``plain``: ``cuboid.CuboidStrategy`` itself, refused by name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ahead import ahead
from harness import WORKERS, launch_and_watch, running, torchrun
from parity_lib import LOSS_RTOL

JOBS = [
    {"name": "killed", "workers": 2, "strategy": {}, "epochs": 2, "kill_at": 6},
    {"name": "resume_tp2", "workers": 4, "strategy": {"tensor_parallel": 2}, "epochs": 3, "run": "killed"},
    {"name": "tp2", "workers": 4, "strategy": {"tensor_parallel": 2}, "epochs": 1},
    {"name": "plain", "workers": 2, "strategy": {}, "epochs": 1, "flavour": "plain", "max_failures": 0},
]
REFERENCES = {"ref_dp2": (2, {}, 3), "ref_tp2": (4, {"tensor_parallel": 2}, 1)}


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-rank*-*.json"))]


@pytest.fixture(scope="module")
@ahead
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ray")
    for name, (procs, strategy, epochs) in REFERENCES.items():
        job = {"name": name, "strategy": strategy, "epochs": epochs}
        torchrun(procs, WORKERS / "ray_job.py", "torchrun", str(out), json.dumps(job))
    code, log, _, seen = launch_and_watch([sys.executable, str(WORKERS / "ray_job.py"), "ray", str(out),
                                           json.dumps(JOBS)], timeout=900)  # fmt: skip
    assert code == 0, log[-6000:]
    got = {name: _records(out, name) for name in [*REFERENCES, *(j["name"] for j in JOBS)]}
    drivers = {j["name"]: json.loads((out / f"{j['name']}-driver.json").read_text()) for j in JOBS}
    return {"records": got, "drivers": drivers, "left": [pid for pid in seen if running(pid)], "log": log,
            "killed_marker": (out / "killed-killed").exists()}  # fmt: skip


def _losses(record: dict) -> dict[int, float]:
    return {step: loss for step, loss in record["losses"]}


def _rel(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() <= b.keys(), (sorted(a), sorted(b))
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


@pytest.mark.slow
def test_ray_workers_train_at_dp2_and_dp2_x_tp2_as_torchrun_does(ran) -> None:
    """Under Ray, with ``devices="auto"`` and Ray's ``prepare_trainer`` (its strategy class check met by the Ray
    flavour), the layout comes from Ray's workers; every rank's step losses equal the torchrun launch's."""
    records = ran["records"]
    assert {r["layout"] for r in records["tp2"]} == {"pp=1 x dp_replicate=1 x dp_shard=2 x tp=2"}
    assert [r["world"] for r in records["tp2"]] == [4, 4, 4, 4]
    for mine, theirs in zip(records["tp2"], records["ref_tp2"], strict=True):
        assert sorted(_losses(mine)) == [1, 2, 3, 4]
        assert _rel(_losses(mine), _losses(theirs)) <= LOSS_RTOL
    assert all(d["error"] is None for n, d in ran["drivers"].items() if n != "plain"), ran["drivers"]


@pytest.mark.slow
def test_the_plain_strategy_under_ray_says_to_use_the_ray_flavour(ran) -> None:
    """``cuboid.CuboidStrategy`` (not the Ray flavour) with ``devices="auto"`` under Ray: refused before any work,
    naming Ray's worker count and ``cuboid.ray.RayCuboidStrategy``."""
    said = ran["drivers"]["plain"]["error"]
    assert (
        "Ray started 2 workers, but the Trainer expects num_nodes (1) x devices (1) = 1. Under Ray Train use "
        "cuboid.ray.RayCuboidStrategy" in said
    ), said


@pytest.mark.slow
def test_a_killed_ray_worker_resumes_the_last_reported_checkpoint(ran) -> None:
    """Rank 1 killed at step 6: Ray restarts the group once (FailureConfig(max_failures=1)); the new workers fit
    from ``ray.train.get_checkpoint()`` (step 4, Cuboid's sharded checkpoint as Ray stored it), so no step is lost
    or run twice beyond those since it: steps 5 to 8 on each rank equal the uninterrupted torchrun run's."""
    assert ran["killed_marker"]
    records = ran["records"]["killed"]
    assert len(records) == 2 and all(r["resumed_from"] for r in records)  # (the killed attempt wrote nothing)
    for mine, theirs in zip(records, ran["records"]["ref_dp2"][:2], strict=True):
        assert sorted(_losses(mine)) == [5, 6, 7, 8]
        assert _rel(_losses(mine), _losses(theirs)) <= LOSS_RTOL
    assert ran["drivers"]["killed"]["metrics"]["step"] == 8


@pytest.mark.slow
def test_a_ray_checkpoint_resumes_at_another_worker_count(ran) -> None:
    """The 2-worker run started again with 4 workers at tp2: ``get_checkpoint()`` gives its step-8 checkpoint, which
    Cuboid reshards to dp2 x tp2; the third epoch's losses equal the dp2 torchrun run's third epoch (the same global
    batch), within the parity bound."""
    records = ran["records"]["resume_tp2"]
    assert len(records) == 4 and all(r["resumed_from"] for r in records)
    reference = _losses(ran["records"]["ref_dp2"][0])
    for record in records[:2]:  # dp rank 0's tp ranks: rank 0's batches
        assert sorted(_losses(record)) == [9, 10, 11, 12]
        assert _rel(_losses(record), reference) <= LOSS_RTOL


@pytest.mark.slow
def test_ray_leaves_no_process_behind(ran) -> None:
    assert ran["left"] == [], ran["left"]
