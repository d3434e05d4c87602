"""A signal to any one rank stops every rank at the same step, with no collective in the signal handler."""

from __future__ import annotations

import json

import pytest
from harness import WORKERS, torchrun_session


@pytest.mark.parametrize("signalled", [1, 0])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, signalled: int) -> None:
    """Rank ``signalled`` gets SIGTERM in the middle of its 4th step. Lightning 2.6 alone stops that rank at the end
    of its step while the other waits in the next step's collective (connection closed, or a hang on NCCL);
    Cuboid's per-step agreement (a host flag all-reduced over gloo) stops both before the 5th step."""
    code, out = torchrun_session(2, WORKERS / "signal_worker.py", str(tmp_path), str(signalled))
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert code == 0, out[-4000:]
    assert facts == [{"exception": "SIGTERMException", "global_step": 4}] * 2, out[-4000:]
