"""A signal to any one rank stops every rank at the same step, with no collective in the signal handler; a
preemption signal also saves one checkpoint, from which a second start resumes the single-process curve."""

from __future__ import annotations

import json

import pytest
import torch
from harness import WORKERS, torchrun, torchrun_session
from parity_lib import reference_run

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5  # the parity bounds (tests/test_parity.py)


@pytest.mark.parametrize("signalled", [1, 0])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, signalled: int) -> None:
    """Rank ``signalled`` gets SIGTERM in the middle of its 4th step. Lightning 2.6 alone stops that rank at the end
    of its step while the other waits in the next step's collective (connection closed, or a hang on NCCL);
    Cuboid's per-step agreement (a host flag all-reduced over gloo) stops both before the 5th step."""
    code, out = torchrun_session(2, WORKERS / "signal_worker.py", str(tmp_path), str(signalled))
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert code == 0, out[-4000:]
    assert facts == [{"exception": "SIGTERMException", "global_step": 4}] * 2, out[-4000:]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """dp2: rank 1 gets SIGUSR1 at the end of step 5 of 12; then a second start resumes with ckpt_path=auto."""
    out = tmp_path_factory.mktemp("preempt")
    root = out / "run"
    specs = [
        {"name": "first", "strategy": {}, "default_root_dir": str(root),
         "signal_at": {"rank": 1, "step": 5, "signal": "SIGUSR1"}},
        {"name": "resumed", "strategy": {}, "resume_from": f"auto:{root / 'checkpoints'}"},
    ]  # fmt: skip
    torchrun(2, WORKERS / "parity_worker.py", str(out), json.dumps(specs))
    return {s["name"]: torch.load(out / f"{s['name']}.pt", weights_only=False) for s in specs}


@pytest.mark.slow
def test_preemption_saves_once_stops_every_rank_and_resumes_the_single_process_curve(preempted) -> None:
    first, resumed = preempted["first"], preempted["resumed"]
    assert [r["stopped_by"] for r in first["ranks"]] == ["SIGTERMException"] * 2
    assert [r["stopped_at"] for r in first["ranks"]] == [5, 5]
    saved = {r["preempted_to"] for r in first["ranks"]}
    assert len(saved) == 1 and saved.pop().endswith("checkpoints/preempted-step=5.ckpt")
    assert [r["stopped_by"] for r in resumed["ranks"]] == [None, None]
    ref = reference_run(1)
    losses = first["losses"] + resumed["losses"]
    assert len(first["losses"]) == 5 and len(losses) == len(ref.losses) == 12
    for got, want in zip(losses, ref.losses, strict=True):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (losses, ref.losses)
    for name, want in ref.params.items():
        err = (resumed["params"][f"model.{name}"] - want).abs().max().item()
        assert err <= PARAM_ATOL, (name, err)
