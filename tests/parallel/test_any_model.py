"""Whatever DDP trains, Cuboid trains (tests/workers/patterns.py: the shapes libraries built on Lightning give their
models): a top-level ``ModuleDict`` or ``ModuleList`` with parameters, an ``LSTM`` subclass whose class
``fully_shard`` cannot swap, and a step that calls a method of its model other than ``forward``. Each at dp2 under
Lightning's DDP and under Cuboid, in one launch: the same losses on every rank and the same weights, within the
parity bound, and what setup kept whole, said."""

from __future__ import annotations

import pytest
from ahead import ahead
from harness import WORKERS, SpecRuns
from parity_lib import LOSS_RTOL, PARAM_ATOL

PATTERNS = ("root_moduledict", "root_modulelist", "abc_lstm", "method_step")


@pytest.fixture(scope="module")
@ahead
def results(tmp_path_factory: pytest.TempPathFactory) -> SpecRuns:
    out = tmp_path_factory.mktemp("any_model")
    specs = [{"name": f"{strategy}-{p}", "strategy": strategy, "module": p} for p in PATTERNS
             for strategy in ("ddp", "cuboid")]  # fmt: skip
    got = SpecRuns(out)
    got.launch(2, WORKERS / "patterns_worker.py", specs)
    return got


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 16
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuboid_trains_it_as_ddp_does(pattern: str, results) -> None:
    ddp, cuboid = results[f"ddp-{pattern}"], results[f"cuboid-{pattern}"]
    loss = max(_rel(mine, theirs) for mine, theirs in zip(cuboid["losses"], ddp["losses"], strict=True))
    params = max((cuboid["params"][k] - v).abs().max().item() for k, v in ddp["params"].items())
    print(f"{pattern}: cuboid vs ddp at dp2: loss {loss:.1e}, params {params:.1e}")
    assert cuboid["params"].keys() == ddp["params"].keys()
    assert loss <= LOSS_RTOL and params <= PARAM_ATOL, (loss, params)


@pytest.mark.slow
def test_setup_says_what_it_kept_whole_and_why(results) -> None:
    def kept(pattern: str) -> str:
        return next((w for w in results[f"cuboid-{pattern}"]["log"] if w.startswith("Cuboid: kept")), "")

    assert "prescalers (ModuleDict: a container without forward; 8 of its children are units)" in kept(
        "root_moduledict"
    )
    assert "layers (ModuleList: a container without forward; 3 of its children are units)" in kept("root_modulelist")
    assert "rnn (Recurrent: fully_shard cannot swap its class)" in kept("abc_lstm")
    assert "model (the step calls its loss(), not forward)" in kept("method_step")
