"""A signal to any one rank stops every rank at the same step, with no collective in the signal handler; a
preemption signal also saves one checkpoint, from which a second start resumes the single-process curve."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from harness import WORKERS, SpecRuns, launch, launch_and_watch, running, torchrun, torchrun_cmd, torchrun_session
from parity_lib import reference_run

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5  # the parity bounds (tests/test_parity.py)


@pytest.mark.parametrize("signalled", [1, 0])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, signalled: int) -> None:
    """Rank ``signalled`` gets SIGTERM in the middle of its 4th step. Lightning 2.6 alone stops that rank at the end
    of its step while the other waits in the next step's collective (connection closed, or a hang on NCCL);
    Cuboid's per-step agreement (a host flag all-reduced over gloo, read one step later so that no step waits on
    it) stops both after the 5th step. (The rank signals itself, so the ranks are forked from the suite's fork
    server, each with Python's default signal handling, as a fresh process has it; the dead-rank tests below use
    torchrun and Lightning's launcher.)"""
    ran = launch(2, WORKERS / "signal_worker.py", str(tmp_path), str(signalled), timeout=120)
    out = ran.out
    assert ran.ok, ran.message()
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert facts == [{"exception": "SIGTERMException", "global_step": 5}] * 2, out[-4000:]
    # SIGTERM is in the default preempt_on: one checkpoint, under the run's own directory (not the working one)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["preempted-step=5.ckpt"]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """dp2: rank 1 gets SIGUSR1 at the end of step 5 of 12 (acted on by both at the end of step 6, when the
    agreement sent at step 5 is read); then a second start resumes with ckpt_path=auto."""
    out = tmp_path_factory.mktemp("preempt")
    root = out / "run"
    specs = [
        {"name": "first", "strategy": {}, "default_root_dir": str(root),
         "signal_at": {"rank": 1, "step": 5, "signal": "SIGUSR1"}},
        {"name": "resumed", "strategy": {}, "resume_from": f"auto:{root / 'checkpoints'}"},
    ]  # fmt: skip
    got = SpecRuns(out)
    got.launch(2, WORKERS / "parity_worker.py", specs)
    return got


@pytest.mark.slow
def test_preemption_saves_once_stops_every_rank_and_resumes_the_single_process_curve(preempted) -> None:
    first, resumed = preempted["first"], preempted["resumed"]
    assert [r["stopped_by"] for r in first["ranks"]] == ["SIGTERMException"] * 2
    assert [r["stopped_at"] for r in first["ranks"]] == [6, 6]
    saved = {r["preempted_to"] for r in first["ranks"]}
    assert len(saved) == 1 and saved.pop().endswith("checkpoints/preempted-step=6.ckpt")
    assert [r["stopped_by"] for r in resumed["ranks"]] == [None, None]
    ref = reference_run(1)
    losses = first["losses"] + resumed["losses"]
    assert len(first["losses"]) == 6 and len(losses) == len(ref.losses) == 12
    for got, want in zip(losses, ref.losses, strict=True):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (losses, ref.losses)
    for name, want in ref.params.items():
        err = (resumed["params"][f"model.{name}"] - want).abs().max().item()
        assert err <= PARAM_ATOL, (name, err)


@pytest.mark.alone  # its seconds are bounded
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_is_named_and_the_others_exit_within_10_s(tmp_path, victim: int, launcher: str) -> None:
    """SIGKILL to one rank mid-step. The other exits non-zero within 10 s with a message naming the dead rank,
    and no process is left. Under torchrun (and srun) Cuboid's watchdog over the rendezvous store names it
    (Lightning's ModelParallelStrategy on gloo took 19 s, without a name); Lightning's own launcher, where rank 0
    starts rank 1, names a dead child itself, and the watchdog names a dead rank 0 (the store's host)."""
    script = [WORKERS / "signal_worker.py", str(tmp_path), str(victim), "SIGKILL"]
    cmd = torchrun_cmd(2, *script) if launcher == "torchrun" else [sys.executable, *map(str, script)]
    code, out, closed, seen = launch_and_watch(cmd, timeout=120)
    sent = json.loads((tmp_path / "signal.json").read_text())["time"]
    assert closed - sent < 10, (closed - sent, out[-3000:])
    names = (f"rank {victim} stopped responding", f"rank {victim} (it hosts the rendezvous store) stopped",
             f"[rank: {victim}] Child process with PID")  # fmt: skip
    assert any(name in out for name in names), out[-3000:]
    assert code != 0
    assert not [pid for pid in seen if running(pid)], seen


@pytest.mark.slow
def test_after_a_killed_rank_the_last_checkpoint_resumes_the_single_process_curve(tmp_path) -> None:
    """dp2, a checkpoint every 2 steps; rank 1 is SIGKILLed at the end of step 5: rank 0 stops (named, exit 3);
    lost: step 5, after the last checkpoint. A second start with ``auto`` takes over the dead run's lock, resumes
    from step=4.ckpt and continues the single-process curve (losses 5-12 and final weights) within the bound."""
    root = tmp_path / "ck"
    killed = [{"name": "killed", "strategy": {}, "save_every": 2, "save_dir": str(root),
               "signal_at": {"rank": 1, "step": 5, "signal": "SIGKILL"}}]  # fmt: skip
    code, out = torchrun_session(2, WORKERS / "parity_worker.py", str(tmp_path), json.dumps(killed), timeout=180)
    assert code != 0 and "rank 1 stopped responding" in out, out[-4000:]
    assert sorted(p.name for p in root.iterdir()) == [".cuboid-run.lock", "step=2.ckpt", "step=4.ckpt"]
    resumed = [{"name": "resumed", "strategy": {}, "save_every": 2, "save_dir": str(root),
                "resume_from": f"auto:{root}"}]  # fmt: skip
    torchrun(2, WORKERS / "parity_worker.py", str(tmp_path), json.dumps(resumed))
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    ref = reference_run(1)
    assert len(got["losses"]) == 8
    for have, want in zip(got["losses"], ref.losses[4:], strict=True):
        assert abs(have - want) <= LOSS_RTOL * abs(want), (got["losses"], ref.losses[4:])
    for name, want in ref.params.items():
        err = (got["params"][f"model.{name}"] - want).abs().max().item()
        assert err <= PARAM_ATOL, (name, err)
    assert not (root / ".cuboid-run.lock").exists()


@pytest.mark.slow
def test_fit_off_the_main_thread_trains_with_the_signals_left_alone(tmp_path) -> None:
    """Ray Train runs the train loop in a worker thread: there Python refuses ``signal.signal`` ("signal only works
    in main thread of the main interpreter", which stopped setup before). Both ranks train their 4 steps."""
    out = torchrun(2, WORKERS / "thread_worker.py", str(tmp_path), timeout=120)
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert facts == [{"rank": r, "steps": 4, "thread": "train-loop"} for r in range(2)], (facts, out[-3000:])
    assert "fit runs off the main thread, where no signal handler can be installed: SIGUSR1" in out
