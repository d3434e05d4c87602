"""Fault-tolerant replica groups (torchft) on CPU: two groups of two ranks, one lighthouse, and inside each group
FSDP over its two ranks, or tp2, or pp2. Group 1 is killed at step 5; group 0 keeps its processes and steps on
alone; group 1, started again, heals from group 0 at a later step and both finish at ``max_steps`` with the same
weights."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from harness import WORKERS, launch

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow  # five launches of two groups per layout

MAX_STEPS, DIE_AT = 16, 5
# inside each group: the CuboidStrategy arguments, and the data-parallel degree (ranks reading their own batch)
LAYOUTS = {"dp2": ({}, 2), "tp2": ({"tensor_parallel": 2}, 1), "pp2": ({"pipeline_parallel": 2, "microbatches": 2}, 1)}


def _lighthouse():
    from torchft._torchft import LighthouseServer

    os.environ.setdefault("RUST_LOG", "error")  # the lighthouse logs every quorum request otherwise

    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=3000)


def _fail_and_rejoin(out: Path, live: dict, dead: dict, again: dict) -> dict:
    """Group 0 (``live``) runs throughout; group 1 runs as ``dead`` until its failure, then, once group 0 has
    stepped alone twice, as ``again``. Each launch's result, by spec name."""
    results: dict = {}

    def group0() -> None:
        results["live0"] = launch(2, WORKERS / "replicas_worker.py", str(out), json.dumps(live), timeout=400)

    t0 = threading.Thread(target=group0)
    t0.start()
    results["dead1"] = launch(2, WORKERS / "replicas_worker.py", str(out), json.dumps(dead), timeout=400)
    deadline = time.monotonic() + 120
    while sum(r["groups"] == 1 for r in _records(out, "live0")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    results["again1"] = launch(2, WORKERS / "replicas_worker.py", str(out), json.dumps(again), timeout=400)
    t0.join()
    return results


def _records(out: Path, name: str, rank: int = 0) -> list[dict]:
    path = out / f"{name}.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _run_groups(specs: list[dict]) -> list:
    """Launch each spec's group at once (each its own job: its own ranks, store and process groups)."""
    results: list = [None] * len(specs)

    def one(i: int) -> None:
        results[i] = launch(2, WORKERS / "replicas_worker.py", str(specs[i]["out"]), json.dumps(specs[i]["spec"]),
                            timeout=400)  # fmt: skip

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp(f"replicas-{request.param}")
    lighthouse = _lighthouse()
    try:
        base = {"groups": 2, "lighthouse": lighthouse.address(), "strategy": LAYOUTS[request.param][0]}
        # no failure: both groups, a few steps (the losses before the failure must equal these)
        (out / "calm").mkdir()
        (out / "start").mkdir()
        calm = _run_groups([{"out": out, "spec": {**base, "name": f"calm{g}", "group": g, "max_steps": DIE_AT + 1,
                                                  "start_with": str(out / "calm")}} for g in (0, 1)])  # fmt: skip
        accumulated = None
        if request.param == "dp2":  # two batches per optimizer step: the average over groups taken into the sum
            (out / "accumulated").mkdir()
            accumulated = _run_groups([{"out": out, "spec": {
                **base, "name": f"accumulated{g}", "group": g, "max_steps": 3, "start_with": str(out / "accumulated"),
                "trainer": {"accumulate_grad_batches": 2}}} for g in (0, 1)])  # fmt: skip
        rejoined, start = str(out / "rejoined"), str(out / "start")
        ckpt = str(out / "ckpt")
        live = {**base, "name": "live0", "group": 0, "max_steps": MAX_STEPS, "slow_after": DIE_AT, "until": rejoined,
                "start_with": start, "ckpt": ckpt}  # fmt: skip
        dead = {**base, "name": "dead1", "group": 1, "max_steps": MAX_STEPS, "die_at": DIE_AT, "start_with": start,
                "ckpt": ckpt}  # fmt: skip
        again = {**base, "name": "again1", "group": 1, "max_steps": MAX_STEPS, "rejoined": rejoined, "ckpt": ckpt}
        results = _fail_and_rejoin(out, live, dead, again)
    finally:
        lighthouse.shutdown()
    return {"out": out, "calm": calm, "accumulated": accumulated, "dp": LAYOUTS[request.param][1], **results}


def test_the_killed_group_dies_at_its_step_and_the_live_group_keeps_its_processes_and_steps_on(runs) -> None:
    out = runs["out"]
    assert not runs["dead1"].ok and "SIGKILL" in runs["dead1"].message(), runs["dead1"].message()
    assert [r["step"] for r in _records(out, "dead1")] == list(range(DIE_AT))
    assert runs["live0"].ok, runs["live0"].message()
    for rank in (0, 1):
        live = _records(out, "live0", rank)
        assert [r["step"] for r in live] == list(range(MAX_STEPS)) and len({r["pid"] for r in live}) == 1
    groups = [r["groups"] for r in _records(out, "live0")]
    assert groups[:DIE_AT] == [2] * DIE_AT and 1 in groups[DIE_AT:], groups  # alone for a while after the kill


def test_a_restarted_group_heals_from_the_live_one_at_a_later_step_and_both_end_with_the_same_weights(runs):
    out = runs["out"]
    assert runs["again1"].ok, runs["again1"].message()
    again, live = _records(out, "again1"), _records(out, "live0")
    first = again[0]["step"]
    assert first > DIE_AT and [r["step"] for r in again] == list(range(first, MAX_STEPS)), [r["step"] for r in again]
    assert all(r["groups"] == 2 for r in again) and [r["groups"] for r in live][first:] == [2] * (MAX_STEPS - first)
    # Lightning's own counters after the heal: the batch index (what validation and logging count by) and the step
    # the loggers are given, as in the live group
    assert [(r["batch_idx"], r["logged_step"]) for r in again] == [(r["batch_idx"], r["logged_step"])
                                                                   for r in live[first:]], (again, live[first:])  # fmt: skip
    a, b = torch.load(out / "live0.pt", weights_only=False), torch.load(out / "again1.pt", weights_only=False)
    assert a["global_step"] == b["global_step"] == MAX_STEPS and a["optimizer_steps"] == b["optimizer_steps"]
    assert sorted(a["params"]) == sorted(b["params"])
    for key, value in a["params"].items():
        assert torch.equal(value, b["params"][key]), key
    # the healed group trains its own slots of the data from the live group's position: the two groups' samples
    # of a step are disjoint (a group's tp or pp peers share theirs)
    for step in range(first, MAX_STEPS):
        live_ids, again_ids = ({i for rank in (0, 1) for r in _records(out, name, rank) if r["step"] == step
                                for i in r["ids"]} for name in ("live0", "again1"))  # fmt: skip
        assert len(live_ids) == len(again_ids) == 2 * runs["dp"] and not live_ids & again_ids, (step, live_ids)


def test_the_losses_before_the_failure_are_the_failure_free_runs(runs) -> None:
    out = runs["out"]
    assert all(r.ok for r in runs["calm"]), [r.message() for r in runs["calm"] if not r.ok]
    calm = [r["loss"] for r in _records(out, "calm0")][:DIE_AT]
    live = [r["loss"] for r in _records(out, "live0")][:DIE_AT]
    assert len(calm) == DIE_AT and live == calm, (live, calm)


def test_one_group_writes_each_checkpoint_and_every_one_verifies(runs) -> None:
    """Every group has the same ModelCheckpoint into one directory; the first group of each step's quorum writes
    (two groups writing the same checkpoint would collide), and each checkpoint verifies against its checksums."""
    from cuboid.checkpoint.sharded import verify_checkpoint

    found = sorted((runs["out"] / "ckpt").glob("step=*.ckpt"))
    assert [p.name for p in found] == [f"step={s}.ckpt" for s in (12, 16, 4, 8)], found
    for path in found:
        verify_checkpoint(path)


def _batches(out: Path, step: int, dp: int, groups: int) -> list[list[int]]:
    """The batches the live groups trained at ``step``, one per data-parallel rank (a group's tp or pp peers
    share theirs): group 0 from its one run, group 1 from whichever of its runs trained that step."""
    found = [[r["ids"] for rank in range(dp) for r in _records(out, "live0", rank) if r["step"] == step]]
    if groups == 2:
        found.append([r["ids"] for name in ("dead1", "again1") for rank in range(dp)
                      for r in _records(out, name, rank) if r["step"] == step])  # fmt: skip
    return [batch for group in found for batch in group]


def test_the_whole_run_is_one_process_replaying_its_quorum_history(runs) -> None:
    """One process, the same initial weights, AdamW and schedule: at each step, the mean of the losses of the batches
    every live group's data-parallel ranks trained (what FSDP's mean inside a group and torchft's mean over the
    groups make). Every step's loss on group 0's rank 0 and the final weights match within the parity bound."""
    _replay(runs["out"], runs["dp"])


def _replay(out: Path, dp: int) -> None:
    """The one-process replay of group 0's record (a step that did not commit: no optimizer step, the schedule's
    step still taken, as Lightning takes it)."""
    from parity_lib import ADAMW, TokenDataset, initial_model, step_loss

    data = TokenDataset()  # the workers' samples, without their ids
    model = initial_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
    live = _records(out, "live0")
    assert [r["step"] for r in live] == list(range(MAX_STEPS))
    for record in live:
        if not record["committed"]:  # no group stepped: only group 0's loss to check
            loss = step_loss(model, torch.stack([data[i]["tokens"] for i in record["ids"]])).item()
            assert abs(loss - record["loss"]) <= 1e-5 * abs(record["loss"]), (record, loss)
            decay.step()
            continue
        batches = _batches(out, record["step"], dp, record["groups"])
        assert len(batches) == dp * record["groups"], (record, batches)
        losses = [step_loss(model, torch.stack([data[i]["tokens"] for i in ids])) for ids in batches]
        assert abs(losses[0].item() - record["loss"]) <= 1e-5 * abs(record["loss"]), (record, losses[0].item())
        opt.zero_grad()
        torch.stack(losses).mean().backward()
        opt.step()
        decay.step()
    got = torch.load(out / "live0.pt", weights_only=False)["params"]
    for name, value in model.state_dict().items():
        assert torch.allclose(got[f"model.{name}"], value, rtol=0, atol=1e-5), (
            name,
            (got[f"model.{name}"] - value).abs().max(),
        )


def test_with_accumulated_batches_each_optimizer_step_is_one_process_stepping_on_every_groups_mean(runs) -> None:
    """``accumulate_grad_batches=2`` in both groups (dp2 inside each): FSDP adds each batch's gradient, averaged
    over the groups, into the last one's. The average over groups must be in before FSDP adds it: torchft divides by
    the number of groups only when its work is waited for, so a wait after the hook returns (where Cuboid used to
    wait) lets FSDP accumulate the sum. One process replays the three optimizer steps (each the mean loss of the
    eight batches, two per rank) and must end with group 0's weights."""
    if runs["accumulated"] is None:
        pytest.skip("run in the dp2 layout only")
    assert all(r.ok for r in runs["accumulated"]), [r.message() for r in runs["accumulated"] if not r.ok]
    from parity_lib import ADAMW, TokenDataset, initial_model, step_loss

    out, data = runs["out"], TokenDataset()
    model = initial_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
    records = {(g, rank): _records(out, f"accumulated{g}", rank) for g in (0, 1) for rank in (0, 1)}
    assert all(len(r) == 6 for r in records.values()), {k: len(v) for k, v in records.items()}
    for step in range(3):
        batches = [r["ids"] for rs in records.values() for r in rs[2 * step : 2 * step + 2]]
        assert all(r["groups"] == 2 and r["committed"] is not False for rs in records.values() for r in rs)
        opt.zero_grad()
        torch.stack(
            [step_loss(model, torch.stack([data[i]["tokens"] for i in ids])) for ids in batches]
        ).mean().backward()
        opt.step()
        decay.step()
    got = torch.load(out / "accumulated0.pt", weights_only=False)["params"]
    for name, value in model.state_dict().items():
        assert torch.allclose(got[f"model.{name}"], value, rtol=0, atol=1e-5), (
            name,
            (got[f"model.{name}"] - value).abs().max(),
        )


def test_a_heal_sends_host_copies_of_this_ranks_shards() -> None:
    """What a live group serves a healing peer is on the host (no second copy of the shards on the device), and a
    host tensor is served as it is (torchft serves it under the lock ``should_commit`` takes)."""
    from cuboid.replicas.groups import _local

    weight = torch.ones(3)
    state = _local({"w": weight, "opt": [{"exp_avg": torch.zeros(2), "step": 3}]})
    assert state["w"].device.type == "cpu" and state["w"].data_ptr() == weight.data_ptr()
    assert state["opt"][0]["step"] == 3 and state["opt"][0]["exp_avg"].device.type == "cpu"


def test_the_groups_process_group_follows_the_training_device_not_the_host(monkeypatch) -> None:
    """``accelerator="cpu"`` on a GPU host trains on the host: the average over groups takes gloo there (NCCL
    would take host tensors and fail at the first backward), and NCCL only for a CUDA device (issue 67, item 6)."""
    from datetime import timedelta

    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    from cuboid.replicas.groups import ReplicaGroups

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as the choice once read it
    made = ReplicaGroups.process_group(timedelta(seconds=5), torch.device("cpu"))
    assert isinstance(made, ProcessGroupGloo) and not isinstance(made, ProcessGroupNCCL), type(made)
    chosen: list[str] = []
    monkeypatch.setattr(ProcessGroupNCCL, "__init__", lambda self, timeout: chosen.append("nccl"))
    ReplicaGroups.process_group(timedelta(seconds=5), torch.device("cuda", 0))
    assert chosen == ["nccl"]


def test_the_ledger_books_the_average_over_groups_as_the_parameter_shards_bytes(runs) -> None:
    """CommLedger books torchft's all-reduces under ``replica_groups``: on a step with both groups, each rank sends
    its gradient shards once, the bytes of its own parameter shards."""
    live = torch.load(runs["out"] / "live0.pt", weights_only=False)
    last = live["comm"][-1]
    assert "replica_groups" in last, last
    assert last["replica_groups"]["all_reduce"][1] == live["shard_bytes"], (last, live["shard_bytes"])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """dp2 in each group: only group 1's rank 1 dies, just before step 5's backward, after that step's quorum (so
    group 0 is waiting for group 1 in the step's average); then group 1 is started again."""
    out = tmp_path_factory.mktemp("replicas-one-rank")
    lighthouse = _lighthouse()
    try:
        base = {"groups": 2, "lighthouse": lighthouse.address(), "strategy": {}, "max_steps": MAX_STEPS}
        start, rejoined = str(out / "start"), str(out / "rejoined")
        (out / "start").mkdir()
        live = {**base, "name": "live0", "group": 0, "slow_after": DIE_AT, "until": rejoined, "start_with": start}
        dead = {**base, "name": "dead1", "group": 1, "die_at": DIE_AT, "die_ranks": [1], "die_in": "backward",
                "start_with": start}  # fmt: skip
        again = {**base, "name": "again1", "group": 1, "rejoined": rejoined}
        results = _fail_and_rejoin(out, live, dead, again)
    finally:
        lighthouse.shutdown()
    return {"out": out, **results}


def test_a_rank_dying_inside_a_group_ends_that_group_and_the_step_it_was_in_commits_nowhere(one_rank) -> None:
    """Group 1's rank 1 is killed; its peer rank 0 ends too (its group's failure), and group 0 goes on with the same
    processes. Step 5, whose average over groups group 1 never finished, is not committed: no group steps (group 0
    notes it), and group 0 trains the later steps alone until group 1 is back."""
    out, dead = one_rank["out"], one_rank["dead1"]
    assert dead.codes[1] == -9 and dead.codes[0] not in (0, None), dead.message()
    assert one_rank["live0"].ok, one_rank["live0"].message()
    for rank in (0, 1):
        live = _records(out, "live0", rank)
        assert [r["step"] for r in live] == list(range(MAX_STEPS)) and len({r["pid"] for r in live}) == 1
    live = _records(out, "live0")
    assert [r["committed"] for r in live[: DIE_AT + 1]] == [True] * DIE_AT + [False], live[: DIE_AT + 1]
    assert live[DIE_AT]["groups"] == 2 and live[DIE_AT + 1]["groups"] == 1, live[DIE_AT : DIE_AT + 2]
    assert all(r["committed"] for r in live[DIE_AT + 1 :]), live
    assert f"step {DIE_AT} not committed" in one_rank["live0"].out


def test_after_a_rank_died_inside_it_the_group_restarts_heals_and_the_run_replays_in_one_process(one_rank) -> None:
    out = one_rank["out"]
    assert one_rank["again1"].ok, one_rank["again1"].message()
    a, b = torch.load(out / "live0.pt", weights_only=False), torch.load(out / "again1.pt", weights_only=False)
    assert a["global_step"] == b["global_step"] == MAX_STEPS and a["optimizer_steps"] == b["optimizer_steps"]
    assert a["optimizer_steps"] == {MAX_STEPS - 1}, a["optimizer_steps"]  # one step did not commit
    for key, value in a["params"].items():
        assert torch.equal(value, b["params"][key]), key
    _replay(out, dp=2)
