"""nonfinite="raise" stops every rank before a NaN reaches the weights, naming the step and the rank;
nonfinite="skip" drops that optimizer step on every rank together."""

from __future__ import annotations

import pytest
import torch
from harness import WORKERS, SpecRuns

from cuboid import CuboidStrategy


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("nonfinite")
    specs = [
        {"name": "raise", "module": "nan_loss", "strategy": {"nonfinite": "raise"}, "expect_error": True},
        {"name": "skip", "module": "nan_loss", "strategy": {"nonfinite": "skip"}},
        {"name": "unguarded", "module": "nan_loss", "strategy": {}, "max_steps": 5},
    ]
    got = SpecRuns(out)
    got.launch(2, WORKERS / "parity_worker.py", specs)
    return got


@pytest.mark.slow
def test_raise_names_the_step_and_the_rank(runs) -> None:
    error = runs["raise"]["error"]
    assert error.startswith("NonFiniteError: step 3: the loss is NaN or infinite on rank(s) [1]"), error
    assert "Stopped before the optimizer step" in error


@pytest.mark.slow
def test_skip_drops_the_step_on_every_rank_and_keeps_the_weights_finite(runs) -> None:
    skip, unguarded = runs["skip"], runs["unguarded"]
    assert [r["skipped"] for r in skip["ranks"]] == [[3], [3]]
    assert [r["stopped_at"] for r in skip["ranks"]] == [12, 12]
    assert all(torch.isfinite(p).all() for p in skip["params"].values())
    assert all(v == v for i, v in enumerate(skip["losses"]) if i != 3)  # the steps after it train on
    # Without the guard the NaN reaches every rank's weights through the gradient reduce-scatter.
    assert not all(torch.isfinite(p).all() for p in unguarded["params"].values())


def test_bad_nonfinite_value_is_refused() -> None:
    with pytest.raises(ValueError, match="nonfinite='sometimes'; choose None"):
        CuboidStrategy(nonfinite="sometimes")
