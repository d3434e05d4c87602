"""Whatever DDP trains, Cuboid trains (tests/workers/patterns.py: the shapes libraries built on Lightning give their
models): a top-level ``ModuleDict`` or ``ModuleList`` with parameters, an ``LSTM`` subclass whose class
``fully_shard`` cannot swap, and a step that calls a method of its model other than ``forward``. Each at dp2 under
Lightning's DDP and under Cuboid, in one launch: the same losses on every rank and the same weights, within the
parity bound, and what setup kept whole, said."""

from __future__ import annotations

import pytest
import torch
from ahead import ahead
from harness import WORKERS, SpecRuns
from parity_lib import LOSS_RTOL, PARAM_ATOL

PATTERNS = ("root_moduledict", "root_modulelist", "abc_lstm", "method_step")


@pytest.fixture(scope="module")
@ahead
def results(tmp_path_factory: pytest.TempPathFactory) -> SpecRuns:
    out = tmp_path_factory.mktemp("any_model")
    specs = [{"name": f"{strategy}-{p}", "strategy": strategy, "module": p, "fit_again": p == "method_step"}
             for p in PATTERNS for strategy in ("ddp", "cuboid", "cuboid_sharded")]  # fmt: skip
    got = SpecRuns(out)
    got.launch(2, WORKERS / "patterns_worker.py", specs)
    return got


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 16
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cuboid", "cuboid_sharded"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuboid_trains_it_as_ddp_does(pattern: str, strategy: str, results) -> None:
    """Cuboid's default (this model fits: replicated, DDP's own all-reduce) and FSDP2 (``data_parallel_shard=
    "auto"``: the units ``fully_shard`` can take, the rest gathered with the LightningModule for each step)."""
    ddp, cuboid = results[f"ddp-{pattern}"], results[f"{strategy}-{pattern}"]
    loss = max(_rel(mine, theirs) for mine, theirs in zip(cuboid["losses"], ddp["losses"], strict=True))
    params = max((cuboid["params"][k] - v).abs().max().item() for k, v in ddp["params"].items())
    print(f"{pattern}: {strategy} vs ddp at dp2: loss {loss:.1e}, params {params:.1e}")
    assert cuboid["params"].keys() == ddp["params"].keys()
    assert loss <= LOSS_RTOL and params <= PARAM_ATOL, (loss, params)


@pytest.mark.slow
def test_setup_says_what_it_kept_whole_and_why(results) -> None:
    def kept(pattern: str) -> str:
        return next((w for w in results[f"cuboid_sharded-{pattern}"]["log"] if w.startswith("Cuboid: kept")), "")

    assert "prescalers (ModuleDict: a container without forward; 8 of its children are units)" in kept(
        "root_moduledict"
    )
    assert "layers (ModuleList: a container without forward; 3 of its children are units)" in kept("root_modulelist")
    assert "rnn (Recurrent: fully_shard cannot swap its class)" in kept("abc_lstm")
    assert "model (the step calls its loss(), not forward)" in kept("method_step")
    for pattern in PATTERNS:  # the default: replicated, said with the figures it was chosen on
        said = [w for w in results[f"cuboid-{pattern}"]["log"] if w.startswith("Cuboid: data parallel")]
        assert said and "replicated, as DDP does" in said[0] and "data_parallel_shard='auto' shards it" in said[0]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= PARAM_ATOL for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
def test_its_best_checkpoint_reloads_as_ddp_era_code_reloads_it(pattern: str, results) -> None:
    """Replicated by default, Cuboid writes DDP's one file: ``Model.load_from_checkpoint(best)`` and
    ``torch.load(best)["state_dict"]`` read DDP's best weights. A sharded model's checkpoint is a directory, read
    whole by ``cuboid.read_model_weights(best)``. The live model takes whole tensors in ``load_state_dict`` either
    way (sharded: each rank keeps its slices)."""
    ddp, default, sharded = (results[f"{s}-{pattern}"] for s in ("ddp", "cuboid", "cuboid_sharded"))
    assert isinstance(ddp["reloaded"], dict), ddp["reloaded"]
    assert _close(default["reloaded"], ddp["reloaded"]) and _close(default["torch_load"], ddp["torch_load"])
    assert isinstance(sharded["reloaded"], str) and "IsADirectoryError" in sharded["reloaded"]  # a directory
    assert _close(sharded["read_weights"], ddp["reloaded"])
    for run in (default, sharded):
        assert all(torch.allclose(d, torch.ones_like(d), atol=1e-6) for d in run["live_load"].values()), run[
            "live_load"
        ]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cuboid", "cuboid_sharded"])
def test_the_strategy_and_the_trainer_pickle_on_every_rank(strategy: str, results) -> None:
    """A library that pickles its forecaster, Trainer included, after fit (issue 72): the strategy pickles before
    and after fit, and the Trainer after it, on every rank (Lightning's DDP fails on rank 0 after fit: its
    launcher's child processes hold a lock; Cuboid's pickle leaves the launcher out, and the process groups)."""
    for pattern in PATTERNS:
        for rank, got in enumerate(results[f"{strategy}-{pattern}"]["pickles"]):
            assert got == {"strategy_before": "CuboidStrategy", "strategy": "CuboidStrategy", "trainer": "Trainer"}, (
                pattern, rank, got)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cuboid", "cuboid_sharded"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_after_fit_the_model_is_what_ddp_leaves(pattern: str, strategy: str, results) -> None:
    """After fit a library calls the model's own methods, loads its ``state_dict()`` into a plain module and
    pickles it (issue 66): on every rank the model is the user's class, whole on the CPU, as under DDP, sharded
    or not, and each of those calls gives DDP's value."""
    ddp, cuboid = results[f"ddp-{pattern}"]["after_fit"], results[f"{strategy}-{pattern}"]["after_fit"]
    cls = {"root_moduledict": "RootModuleDict", "root_modulelist": "RootModuleList", "abc_lstm": "AbcLstm",
           "method_step": "MethodStep"}[pattern]  # fmt: skip
    expected = {"class": cls, "model_class": cls, "devices": ["cpu"], "kinds": ["Tensor"]}
    assert {k: ddp[k] for k in expected} == expected, ddp
    assert {k: cuboid[k] for k in expected} == expected, cuboid
    for call in ("method", "predict_step", "plain_load", "unpickled"):
        assert isinstance(cuboid[call], float), (call, cuboid[call])
        assert abs(cuboid[call] - ddp[call]) <= LOSS_RTOL * abs(ddp[call]), (call, cuboid[call], ddp[call])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cuboid", "cuboid_sharded"])
def test_a_second_fit_trains_the_same_module_again(strategy: str, results) -> None:
    """The module a fit left plain is set up anew by the next fit (sharded again under ``data_parallel_shard``):
    its steps follow DDP's second fit."""
    ddp, cuboid = results["ddp-method_step"]["again"], results[f"{strategy}-method_step"]["again"]
    assert len(cuboid["losses"]) == len(ddp["losses"]) == 4
    assert max(abs(a - b) / abs(b) for a, b in zip(cuboid["losses"], ddp["losses"], strict=True)) <= LOSS_RTOL
    assert max((cuboid["params"][k] - v).abs().max().item() for k, v in ddp["params"].items()) <= PARAM_ATOL
