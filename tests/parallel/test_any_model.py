"""Whatever DDP trains, Cuboid trains (tests/workers/patterns.py: the shapes libraries built on Lightning give their
models): a top-level ``ModuleDict`` or ``ModuleList`` with parameters, an ``LSTM`` subclass whose class
``fully_shard`` cannot swap, and a step that calls a method of its model other than ``forward``. Each at dp2 under
Lightning's DDP and under Cuboid, in one launch: the same losses on every rank and the same weights, within the
parity bound, and what setup kept whole, said."""

from __future__ import annotations

import sys

import lightning as L
import pytest
import torch
from ahead import ahead
from harness import WORKERS, SpecRuns
from parity_lib import LOSS_RTOL, PARAM_ATOL

PATTERNS = (
    "root_moduledict",
    "root_modulelist",
    "abc_lstm",
    "method_step",
    "manual_gan",
    "asks_ddp",
    "own_ema",
)


@pytest.fixture(scope="module")
@ahead
def results(tmp_path_factory: pytest.TempPathFactory) -> SpecRuns:
    out = tmp_path_factory.mktemp("any_model")
    # (DDP itself needs find_unused_parameters for the GAN: the generator takes no part in the discriminator's loss)
    ddp = {"manual_gan": "ddp_find_unused_parameters_true"}
    specs = [{"name": f"{strategy}-{p}", "strategy": ddp.get(p, "ddp") if strategy == "ddp" else strategy,
              "module": p, "fit_again": p == "method_step"}
             for p in PATTERNS for strategy in ("ddp", "cuboid", "cuboid_sharded")]  # fmt: skip
    specs += [{"name": f"{strategy}-plugin", "strategy": strategy, "module": "method_step", "plugin": True,
               "kwargs": {"checkpoint_format": "full"} if strategy == "cuboid_sharded" else {}}
              for strategy in ("ddp", "cuboid", "cuboid_sharded")]  # fmt: skip
    plan = {"gen.0": "colwise", "gen.2": "rowwise", "disc.0": "colwise", "disc.2": "rowwise"}  # a GAN at tp2
    specs += [{"name": "cuboid_tp2-manual_gan", "strategy": "cuboid", "module": "manual_gan", "fit_again": True,
               "kwargs": {"tensor_parallel": 2, "tensor_parallel_plan": plan}}]  # fmt: skip
    # kept sharded after the run (activation checkpointing): the methods a library calls gathered for the call
    specs += [{"name": "cuboid_kept-method_step", "strategy": "cuboid_sharded", "module": "method_step",
               "fit_again": True, "kwargs": {"activation_checkpointing": "full"}}]  # fmt: skip
    # (not under DDP: Lightning's re-made loader hands the step [[x, y]] for (x, y), and it stops)
    specs += [{"name": f"{strategy}-batched_sampler", "strategy": strategy, "module": "batched_sampler"}
              for strategy in ("cuboid", "cuboid_sharded")]  # fmt: skip
    specs += [{"name": f"{strategy}-{averaging}", "strategy": strategy, "module": "root_moduledict",
               "averaging": averaging, "kwargs": {"checkpoint_format": "full"} if strategy == "cuboid_sharded" else {}}
              for averaging in ("ema", "swa") for strategy in ("ddp", "cuboid", "cuboid_sharded")]  # fmt: skip
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
           "method_step": "MethodStep", "manual_gan": "ManualGan", "asks_ddp": "AsksDdp", "own_ema": "OwnEma"}[pattern]  # fmt: skip
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


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cuboid", "cuboid_sharded"])
def test_a_library_that_asks_for_ddp_gets_its_ddp_path_and_its_batches(strategy: str, results) -> None:
    """A library that chooses its data path by ``isinstance(strategy, DDPStrategy)`` (scvi-tools; issues 66 and 72)
    takes its DDP path under Cuboid: its own distributed batch sampler, DDP's batches and losses (the losses in
    test_cuboid_trains_it_as_ddp_does). Its single-process loader, a ``BatchSampler`` passed as ``sampler=`` that
    Lightning makes again around its ``DistributedSamplerWrapper``, yields the library's batches too: Lightning's
    DDP batches each of them once more (the step gets ``[[x, y]]`` for ``(x, y)``, and stops), Cuboid turns
    automatic batching off again, and it trains."""
    ddp, cuboid = results["ddp-asks_ddp"], results[f"{strategy}-asks_ddp"]
    assert cuboid["sampler"] == ddp["sampler"] == "BatchDistributedSampler", (cuboid["sampler"], ddp["sampler"])
    assert cuboid["shapes"] == ddp["shapes"] == [[4, 8]] * 16, cuboid["shapes"]
    single = results[f"{strategy}-batched_sampler"]
    assert single["sampler"] == "DistributedSamplerWrapper" and single["shapes"] == [[4, 8]] * 16, single["shapes"]
    assert any("yields whole batches with automatic batching off" in line for line in single["log"]), single["log"]
    losses = [sum(rank) / 2 for rank in zip(*single["losses"], strict=True)]
    assert len(losses) == 16 and sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses  # it trains


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cuboid", "cuboid_sharded"])
def test_a_modules_own_average_validates_as_under_ddp(strategy: str, results) -> None:
    """A module's own EMA in plain tensors, copied into its parameters for validation (issue 66: sharded, it
    stopped at the first validation, "got mixed torch.Tensor and DTensor"): sharded as the parameters are, its
    validation losses (on the average) and the average itself equal DDP's; setup says it."""
    ddp, cuboid = results["ddp-own_ema"], results[f"{strategy}-own_ema"]
    assert cuboid["validated"] == pytest.approx(ddp["validated"], rel=LOSS_RTOL, abs=0), (
        cuboid["validated"],
        ddp["validated"],
    )
    assert len(cuboid["own_average"]) == len(ddp["own_average"]) == 4
    assert all(
        (a - b).abs().max() <= PARAM_ATOL for a, b in zip(cuboid["own_average"], ddp["own_average"], strict=True)
    )
    said = [w for w in cuboid["log"] if "own copies of its parameters" in w]
    assert bool(said) == (strategy == "cuboid_sharded") and (not said or "(ema)" in said[0]), said


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cuboid", "cuboid_sharded"])
@pytest.mark.parametrize("averaging", ["ema", "swa"])
def test_lightnings_weight_averaging_gives_ddps_numbers(averaging: str, strategy: str, results) -> None:
    """``EMAWeightAveraging`` and ``StochasticWeightAveraging`` (issue 66): their whole copy of the model sharded as
    the model is (``data_parallel_shard``), every update, swap for validation and final copy equals DDP's; the
    best checkpoint (one file) holds the average in ``state_dict`` and the live weights under
    ``current_model_state`` (EMA), as DDP's does, and a fit resumed from it goes on as DDP's."""
    ddp, cuboid = results[f"ddp-{averaging}"], results[f"{strategy}-{averaging}"]
    loss = max(_rel(mine, theirs) for mine, theirs in zip(cuboid["losses"], ddp["losses"], strict=True))
    params = max((cuboid["params"][k] - v).abs().max().item() for k, v in ddp["params"].items())
    print(f"{averaging}: {strategy} vs ddp at dp2: loss {loss:.1e}, params {params:.1e}")
    assert loss <= LOSS_RTOL and params <= PARAM_ATOL, (loss, params)
    assert _close(cuboid["torch_load"], ddp["torch_load"]), (cuboid["torch_load"], ddp["torch_load"])
    if averaging == "swa":  # (EMAWeightAveraging holds torch's local ema_update: no Trainer with it pickles)
        assert all(got["trainer"] == "Trainer" for got in cuboid["pickles"]), cuboid["pickles"]  # its copy too
    assert cuboid["copy_kinds"] == ddp["copy_kinds"] == ["Tensor"], cuboid["copy_kinds"]  # whole again after the run
    if averaging == "ema":
        assert isinstance(ddp["current_model_state"], dict) and ddp["current_model_state"]
        assert _close(cuboid["current_model_state"], ddp["current_model_state"])
        assert not _close(ddp["current_model_state"], ddp["torch_load"])  # the average is not the live weights
        mine, theirs = cuboid["resumed"], ddp["resumed"]  # resumed from it: the live weights and the average go on
        assert len(mine["losses"]) == len(theirs["losses"]) == 8
        assert max(abs(a - b) / abs(b) for a, b in zip(mine["losses"], theirs["losses"], strict=True)) <= LOSS_RTOL
        assert _close(mine["params"], theirs["params"]) and _close(mine["average"], theirs["average"])


def _gan_in_one_process(batch_size: int, start: dict | None = None, epochs: int = 2, batches: int = 8) -> dict:
    """The GAN in one process, ``batch_size`` samples a step in ``DistributedSampler``'s order, the same seed and
    epochs (``start``: its weights before the fit, else its seeded init)."""
    from torch.utils.data import DataLoader, DistributedSampler

    sys.path.insert(0, str(WORKERS))
    from patterns import ManualGan, data

    L.seed_everything(0, verbose=False)
    module = ManualGan()
    if start is not None:
        module.load_state_dict(start)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, limit_train_batches=batches, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)  # fmt: skip
    sampler = DistributedSampler(data(), num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(module, DataLoader(data(), batch_size=batch_size, sampler=sampler))
    x, y = data(8)[:]
    with torch.no_grad():  # what a library reads after fit (patterns_worker._after_fit)
        after = {"method": float(module.loss((x, y))), "predict_step": float(module.predict_step((x, y), 0).sum())}
    return {"losses": list(module.step_losses), "after_fit": after,
            "params": {k: v.detach().clone() for k, v in module.state_dict().items()}}  # fmt: skip


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The two ranks' batches as one: 8 samples a step (the permutation the two ranks deal, rank 0 every even
    position)."""
    return _gan_in_one_process(8)


@pytest.mark.slow
def test_a_model_kept_sharded_answers_a_librarys_calls_after_fit(results) -> None:
    """A model the run's end keeps sharded (activation checkpointing, here at dp2 with FSDP2; issue 66, item 3)
    stays sharded (an instance of the user's class: FSDP2's subclass of it), and on every rank a method other than ``forward`` (the module's
    ``loss``, which calls its submodule's own ``loss``) gives DDP's value, gathered for the call;
    ``cuboid.whole_state_dict`` loads into a plain module with DDP's value; ``state_dict()`` itself keeps the
    shards, and pickling is refused by name. A second fit trains on from the first's weights as DDP's does."""
    ddp, kept = results["ddp-method_step"], results["cuboid_kept-method_step"]
    after = kept["after_fit"]
    assert {k: after[k] for k in ("class", "model_class", "kinds")} == {  # FSDP2's subclass of the user's class
        "class": "FSDPMethodStep", "model_class": "FSDPMethodStep", "kinds": ["DTensor"]}, after  # fmt: skip
    for call, want in (("method", "method"), ("predict_step", "predict_step"), ("whole_load", "method")):
        assert isinstance(after[call], float), (call, after[call])
        assert abs(after[call] - ddp["after_fit"][want]) <= LOSS_RTOL * abs(ddp["after_fit"][want]), (call, after)
    assert isinstance(after["plain_load"], str), after["plain_load"]  # shards: a plain module cannot take them
    assert "cannot be pickled: CuboidStrategy keeps it sharded after the run (activation_checkpointing" in after[
        "unpickled"], after["unpickled"]  # fmt: skip
    said = [line for line in kept["log"] if line.startswith("Cuboid: the model stays sharded after the run")]
    assert said and "MethodStep.loss, Net.loss gather what they read when a call meets" in said[0], said
    steps = max(abs(a - b) / abs(b) for a, b in zip(kept["again"]["losses"], ddp["again"]["losses"], strict=True))
    assert len(kept["again"]["losses"]) == 4 and steps <= LOSS_RTOL, kept["again"]["losses"]
    assert max((kept["again"]["params"][k] - v).abs().max().item() for k, v in ddp["again"]["params"].items()) <= (
        PARAM_ATOL)  # fmt: skip


@pytest.mark.slow
def test_manual_optimization_at_tp2_matches_one_process(results) -> None:
    """The same GAN at tp2 (both ranks read the same 4 samples; each Linear split column- then row-wise): every
    step's losses and the final weights equal one process's on those 4 samples (issue 66's manual optimization
    on every layout that allows it; pp refuses it by name)."""
    got, one = results["cuboid_tp2-manual_gan"], _gan_in_one_process(4)
    for rank in got["losses"]:  # each tp rank's own step losses: the same batch
        assert len(rank) == 16
        assert max(abs(a - b) / abs(b) for a, b in zip(rank, one["losses"], strict=True)) <= LOSS_RTOL
    assert max((got["params"][k] - v).abs().max().item() for k, v in one["params"].items()) <= PARAM_ATOL


@pytest.mark.slow
def test_after_a_tp2_fit_the_model_is_plain_and_the_next_fit_splits_it_again(results) -> None:
    """After fit at tp2 (Cuboid's own tensor parallel) a library's calls meet what DDP leaves (issue 66, item 3):
    on both ranks the user's class with plain whole tensors on the CPU, tensor parallel's hooks gone, so a method
    other than ``forward``, ``predict_step``, ``state_dict()`` into a plain module and ``pickle`` each give one
    process's value on its final weights; a second fit of the same module splits it again and follows one process
    from those weights (its 4 steps, a fresh optimizer, the sampler's first epoch)."""
    got, one = results["cuboid_tp2-manual_gan"], _gan_in_one_process(4)
    expected = {"class": "ManualGan", "model_class": "ManualGan", "devices": ["cpu"], "kinds": ["Tensor"]}
    after = got["after_fit"]
    assert {k: after[k] for k in expected} == expected, after
    for call in ("method", "predict_step", "plain_load", "unpickled"):
        want = one["after_fit"]["predict_step" if call == "predict_step" else "method"]
        assert isinstance(after[call], float), (call, after[call])
        assert abs(after[call] - want) <= LOSS_RTOL * abs(want), (call, after[call], want)
    again = _gan_in_one_process(4, start=one["params"], epochs=1, batches=4)
    assert len(got["again"]["losses"]) == len(again["losses"]) == 4
    assert max(abs(a - b) / abs(b) for a, b in zip(got["again"]["losses"], again["losses"], strict=True)) <= LOSS_RTOL
    assert max((got["again"]["params"][k] - v).abs().max().item() for k, v in again["params"].items()) <= PARAM_ATOL
    assert any("whole on every rank again after the run" in line for line in got["log"]), got["log"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "cuboid", "cuboid_sharded"])
def test_manual_optimization_matches_one_process(strategy: str, results, one_process) -> None:
    """Two optimizers, ``toggle_optimizer``, two ``manual_backward`` a step, accumulation and clipping by hand
    (issue 66): at dp2, Lightning's DDP, Cuboid's replicated default (torch's DDP, its reducer prepared for each
    ``manual_backward`` as Lightning's DDP does: without it the default's step 2 is already off and step 4 fails
    in DDP's bucket rebuild) and FSDP2 each follow one process with the whole batch."""
    got = results[f"{strategy}-manual_gan"]
    steps = [(a + b) / 2 for a, b in zip(*got["losses"], strict=True)]  # each rank's batch mean, averaged
    loss = max(abs(a - b) / abs(b) for a, b in zip(steps, one_process["losses"], strict=True))
    params = max((got["params"][k] - v).abs().max().item() for k, v in one_process["params"].items())
    print(f"manual_gan: {strategy} at dp2 vs one process: loss {loss:.1e}, params {params:.1e}")
    assert len(steps) == 16 and loss <= LOSS_RTOL and params <= PARAM_ATOL, (loss, params)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cuboid", "cuboid_sharded"])
def test_a_librarys_checkpoint_io_plugin_is_used_as_ddp_uses_it(strategy: str, results) -> None:
    """A library's own ``CheckpointIO`` plugin (darts passes one to every Trainer; issue 66): replicated by default,
    and sharded with ``checkpoint_format="full"``, each save goes through its ``save_checkpoint`` on rank 0, the
    removal of the worse checkpoint through its ``remove_checkpoint``, and ``validate(ckpt_path="best")`` reads
    through its ``load_checkpoint`` on every rank: the calls DDP makes, the same files left, the same best weights
    (the sharded format with a plugin is refused at setup: tests/test_bad_input.py)."""
    ddp, cuboid = results["ddp-plugin"], results[f"{strategy}-plugin"]
    saves = [("save", "epoch=0.ckpt"), ("save", "epoch=1.ckpt"), ("remove", "epoch=0.ckpt")]  # rank 0's
    assert ddp["calls"] == [[*saves, ("load", "epoch=1.ckpt")], [("load", "epoch=1.ckpt")]], ddp["calls"]
    assert cuboid["calls"] == ddp["calls"], (cuboid["calls"], ddp["calls"])
    assert cuboid["files"] == ddp["files"] and cuboid["best"] == ddp["best"]
    assert cuboid["best_state"].keys() == ddp["best_state"].keys()
    assert all((cuboid["best_state"][k] - v).abs().max() <= PARAM_ATOL for k, v in ddp["best_state"].items())
    assert cuboid["validated"][0]["val_loss"] == pytest.approx(ddp["validated"][0]["val_loss"], rel=LOSS_RTOL)


class _Stage(torch.nn.Module):
    """A pipeline stage's module: its own weight, and a method that needs a piece another rank holds."""

    def __init__(self) -> None:
        super().__init__()
        self.head: torch.nn.Linear | None = None  # (on another rank)
        self.body = torch.nn.Linear(2, 2)

    def width(self) -> int:
        return self.body.in_features

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # type: ignore[misc]


def test_after_a_pipeline_run_a_method_that_needs_another_stage_is_refused_by_name() -> None:
    """Under pp (``serve_calls`` with a refusal): a method that reads only this rank's pieces runs as it is (a
    caller on one rank alone waits on nobody); one that fails raises a ``RuntimeError`` that names the method, why
    this rank cannot run it and what to call instead, from the method's own error. ``release_calls`` undoes it."""
    from cuboid.dropin import release_calls, serve_calls

    stage = _Stage()
    wrapped = serve_calls(stage, "pipeline_parallel=2 split it otherwise than over the data-parallel ranks")
    assert wrapped == ["_Stage.width", "_Stage.score"], wrapped
    assert stage.width() == 2
    with pytest.raises(RuntimeError, match=r"_Stage.score\(\) after the run: CuboidStrategy keeps the model split "
                       r"\(pipeline_parallel=2 .*\(TypeError: 'NoneType' object is not callable\)\. Build the "
                       r"model anew and load cuboid.whole_state_dict\(model\)") as caught:  # fmt: skip
        stage.score(torch.ones(1, 2))
    assert isinstance(caught.value.__cause__, TypeError)
    release_calls(stage)
    assert "score" not in vars(stage) and "width" not in vars(stage)
