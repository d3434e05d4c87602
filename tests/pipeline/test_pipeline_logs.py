"""Under pipeline parallel, every rank sees what the last stage's step logged, without an object collective per
step: names that appear on some steps only, Python numbers, a torchmetrics metric logged as an object, and a list
state (CatMetric) whose tensors never travel pickled."""

from __future__ import annotations

import json

import pytest
from harness import WORKERS, torchrun_session


@pytest.mark.slow
def test_logs_and_metric_states_reach_every_pipeline_rank(tmp_path) -> None:
    code, out = torchrun_session(2, WORKERS / "pp_logs_worker.py", str(tmp_path), timeout=120)
    assert code == 0, out[-4000:]
    first, last = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first["metrics"] == last["metrics"], (first, last)
    assert set(first["metrics"]) == {"train_loss", "every_third", "mean_loss"}
    # 8 steps (64 samples in batches of 8), 2 microbatches each; the last step logging every_third was step 6.
    assert first["metrics"]["every_third"] == 3.0
    assert first["update_count"] == last["update_count"] == 16
    mb = last["losses"]
    assert len(mb) == 16 and first["losses"] == []  # the step runs on the last stage only
    assert first["metrics"]["mean_loss"] == pytest.approx(sum(mb) / len(mb), rel=1e-6)
    assert first["metrics"]["train_loss"] == pytest.approx((mb[-2] + mb[-1]) / 2, rel=1e-6)
    # A CatMetric's list state: every microbatch's loss on every rank, on the rank's own device, and no tensor sent
    # pickled (it would unpickle on the sender's device: another rank's GPU).
    assert first["cat"] == pytest.approx(mb, rel=1e-6) and last["cat"] == pytest.approx(mb, rel=1e-6)
    assert first["cat_devices"] == last["cat_devices"] == ["cpu"]
    assert first["pickled_tensors"] == last["pickled_tensors"] == []
