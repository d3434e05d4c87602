"""The data position travels with the checkpoint: a mid-epoch resume on another dp degree or per-rank batch trains
on the samples the uninterrupted run would have, and reads none of those it skips.

96 samples, Lightning's ``DistributedSampler`` (shuffled, the global seed), a checkpoint at step 4 of dp2 x batch 4
(32 samples consumed). Resumed at dp2 x 4, dp4 x 2 and dp1 x 8 (the same global batch of 8), each later step's
global batch is the uninterrupted run's, and the final weights match it; at dp4 x 3 (a global batch of 12) every
one of the 64 samples the epoch had not reached is trained once. Before, a resume drew and dropped the epoch's
trained batches, counted per rank: 80 samples read to train 48 at dp4 x 2, and 16 never trained at dp4 x 3.
The parity suite's Llama saved on dp2 x tp2 resumes on pp2 x dp2 the same way. torchdata's StatefulDataLoader
resumes through the Trainer (exact on any degree over a map-style dataset; per-rank state at the same degree, and
refused on another), and so does litdata's StreamingDataLoader (per-rank state); ``data_position="epoch"`` reads the interrupted epoch again from its start.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from harness import WORKERS, SpecRuns

SAVED = 4  # the step of the checkpoint
GLOBAL = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SpecRuns:
    out = tmp_path_factory.mktemp("position")
    got = SpecRuns(out)
    ckpt = str(out / "first" / f"step={SAVED}.ckpt")
    # torchdata's StatefulDataLoader: over the same map-style dataset (shuffled), and over a stream that deals
    # itself by rank and keeps its own state (one state per dp rank, which another dp degree cannot take)
    first_of = {kind: str(out / f"first-{kind}" / f"step={SAVED}.ckpt") for kind in ("stateful", "stream", "litdata")}
    epoch = {"data_position": "epoch"}
    # litdata's StreamingDataLoader over chunks written beforehand, as users prepare them
    worker = importlib.util.spec_from_file_location("position_worker", WORKERS / "position_worker.py")
    module = importlib.util.module_from_spec(worker)
    worker.loader.exec_module(module)
    module.write_litdata(out / "litdata")
    lit = {"litdata": str(out / "litdata")}
    got.launch(2, WORKERS / "position_worker.py", [
        {"name": "uninterrupted", "batch": 4, "max_steps": 12},
        {"name": "first", "batch": 4, "max_steps": SAVED, "save_every": SAVED},
        {"name": "dp2x4", "batch": 4, "max_steps": 12, "resume_from": ckpt},
        {"name": "other-dataset", "batch": 4, "max_steps": 12, "resume_from": ckpt, "samples": 90,
         "expect_error": True},
        *(spec for kind in ("stateful", "stream", "litdata") for spec in (
            {"name": f"uninterrupted-{kind}", "batch": 4, "max_steps": 12, "loader": kind, **lit},
            {"name": f"first-{kind}", "batch": 4, "max_steps": SAVED, "save_every": SAVED, "loader": kind, **lit},
            {"name": f"dp2x4-{kind}", "batch": 4, "max_steps": 12, "resume_from": first_of[kind], "loader": kind, **lit},
        )),
    ])  # fmt: skip
    got.launch(4, WORKERS / "position_worker.py", [
        {"name": "dp4x2", "batch": 2, "max_steps": 12, "resume_from": ckpt},
        {"name": "dp4x3", "batch": 3, "max_steps": 12, "resume_from": ckpt},
        {"name": "dp4x2-epoch", "batch": 2, "max_steps": 12, "resume_from": ckpt, "strategy": epoch},
        {"name": "dp4x2-stateful", "batch": 2, "max_steps": 12, "resume_from": first_of["stateful"],
         "loader": "stateful"},
        {"name": "dp4x2-stream", "batch": 2, "max_steps": 12, "resume_from": first_of["stream"], "loader": "stream",
         "expect_error": True},
        {"name": "dp4x2-stream-epoch", "batch": 2, "max_steps": 12, "resume_from": first_of["stream"],
         "loader": "stream", "strategy": epoch},
        # litdata under tensor parallel: Cuboid hands it the data-parallel ranks
        {"name": "dp2xtp2-litdata", "batch": 4, "max_steps": 12, "loader": "litdata", **lit,
         "strategy": {"tensor_parallel": 2, "tensor_parallel_plan": {"net.0": "colwise", "net.2": "rowwise"}}},
        {"name": "dp4x2-litdata", "batch": 2, "max_steps": 12, "resume_from": first_of["litdata"], "loader": "litdata",
         "expect_error": True, **lit},
        # the parity suite's Llama: saved on dp2 x tp2 at step 4, resumed on pp2 x dp2
        {"name": "dp2xtp2-llama", "batch": 4, "max_steps": 12, "save_every": SAVED, "loader": "llama",
         "strategy": {"tensor_parallel": 2}},
        {"name": "pp2xdp2-llama", "batch": 4, "max_steps": 12, "loader": "llama",
         "resume_from": str(out / "dp2xtp2-llama" / f"step={SAVED}.ckpt"), "strategy": {"pipeline_parallel": 2}},
    ])  # fmt: skip
    got.launch(1, WORKERS / "position_worker.py", [{"name": "dp1x8", "batch": 8, "max_steps": 12, "resume_from": ckpt}])
    return got


def global_batches(run: dict) -> list[list[int]]:
    """Per step, the sorted ids every rank trained on."""
    return [sorted(i for rank in step for i in rank) for step in zip(*run["ids"], strict=True)]


@pytest.mark.parametrize("name", ["dp2x4", "dp4x2", "dp1x8"])
def test_the_same_global_batch_resumes_on_the_uninterrupted_runs_samples(name: str, runs) -> None:
    whole, resumed = global_batches(runs["uninterrupted"]), global_batches(runs[name])
    assert len(whole) == 12 and resumed == whole[SAVED:], (name, resumed, whole[SAVED:])
    for key, value in runs["uninterrupted"]["params"].items():
        assert torch.allclose(runs[name]["params"][key], value, rtol=0, atol=1e-6), (name, key)


@pytest.mark.parametrize("name", ["dp2x4", "dp4x2", "dp4x3", "dp1x8"])
def test_a_resume_reads_none_of_the_samples_it_skips(name: str, runs) -> None:
    """Every id a rank read from the dataset, it trained on: nothing drawn to be dropped."""
    read = sorted(i for rank in runs[name]["read"] for i in rank)
    trained = sorted(i for step in global_batches(runs[name]) for i in step)
    assert read == trained, (name, len(read), len(trained))


def test_another_global_batch_trains_each_remaining_sample_once(runs) -> None:
    """dp4 x 3: the 64 samples the epoch had not reached, each once; none of the 32 trained before."""
    before = {i for step in global_batches(runs["first"]) for i in step}
    after = [i for step in global_batches(runs["dp4x3"]) for i in step]
    assert len(before) == SAVED * GLOBAL
    assert sorted(after) == sorted(set(range(96)) - before)


def test_a_position_in_another_dataset_is_refused_naming_both_lengths(runs) -> None:
    error = runs["other-dataset"]["error"]
    assert error and "96 samples in the dataset" in error and "this run has 90" in error, error


@pytest.mark.parametrize(
    ("name", "whole"),
    [("dp2x4-stateful", "uninterrupted-stateful"), ("dp4x2-stateful", "uninterrupted-stateful"),
     ("dp2x4-stream", "uninterrupted-stream"), ("dp2x4-litdata", "uninterrupted-litdata")],
)  # fmt: skip
def test_a_stateful_dataloader_resumes_through_the_trainer_on_the_uninterrupted_runs_samples(name, whole, runs):
    """torchdata's StatefulDataLoader. Over a map-style dataset it is dealt like a DataLoader (Lightning's
    DistributedSampler; Lightning alone wraps torchdata's sampler, whose order no restored state reproduces), so it
    resumes at the data position on any degree. Over a stream with its own state, each dp rank gets its own state
    back through the Trainer: the state after the batches trained, not Lightning's one batch ahead. Either way, the
    uninterrupted run's global batches, and nothing skipped is read."""
    resumed, uninterrupted = global_batches(runs[name]), global_batches(runs[whole])
    assert sorted(i for step in uninterrupted for i in step) == list(range(96)), (whole, uninterrupted)  # dealt once
    assert len(uninterrupted) == 12 and resumed == uninterrupted[SAVED:], (name, resumed, uninterrupted[SAVED:])
    read = sorted(i for rank in runs[name]["read"] for i in rank)
    assert read == sorted(i for step in resumed for i in step), (name, len(read))


def test_litdata_is_dealt_over_the_data_parallel_ranks_under_tensor_parallel(runs) -> None:
    """litdata deals a StreamingDataset over every rank of the default process group; at dp2 x tp2 Cuboid hands it
    the 2 data-parallel ranks instead, so each tp pair reads the same batches, and the global batches are dp2's."""
    ids = runs["dp2xtp2-litdata"]["ids"]  # per rank, per step
    pairs = sorted({tuple(map(tuple, rank)) for rank in ids})
    assert len(pairs) == 2 and all(ids.count([list(b) for b in pair]) == 2 for pair in pairs), ids
    dealt = [sorted(i for pair in pairs for i in pair[step]) for step in range(12)]
    assert dealt == global_batches(runs["uninterrupted-litdata"]), dealt


@pytest.mark.parametrize(("name", "loader"), [("dp4x2-stream", "StatefulDataLoader"),
                                             ("dp4x2-litdata", "StreamingDataLoader")])  # fmt: skip
def test_loader_state_kept_per_rank_is_refused_on_another_degree_naming_loader_degrees_and_choices(
    name: str, loader: str, runs
) -> None:
    error = runs[name]["error"]
    assert error and loader in error and "over 2 data-parallel ranks" in error, error
    assert "this run has 4" in error and "data_position='epoch'" in error and "No step was run" in error, error
    assert runs[name]["ids"] == [[], [], [], []]  # refused before any step


def test_data_position_epoch_reads_the_interrupted_epoch_again_from_its_start(runs) -> None:
    """data_position='epoch' on dp4: the map-style epoch from its start (the uninterrupted run's first global
    batches, the same global batch of 8), and the stream restarted on 4 ranks (every id once, none of the 4 ranks'
    shares skipped)."""
    assert global_batches(runs["dp4x2-epoch"]) == global_batches(runs["uninterrupted"])[: 12 - SAVED]
    order = torch.randperm(96, generator=torch.Generator().manual_seed(1)).tolist()  # the stream's (the worker's)
    for rank, steps in enumerate(runs["dp4x2-stream-epoch"]["ids"]):
        assert [i for step in steps for i in step] == order[rank::4][: (12 - SAVED) * 2], rank


def test_a_resume_from_tensor_to_pipeline_parallel_trains_the_same_samples_to_the_same_weights(runs) -> None:
    """The parity suite's Llama, saved at step 4 of dp2 x tp2 and resumed on pp2 x dp2 (the same global batch of
    8): each later step's global batch is the uninterrupted dp2 x tp2 run's, and the final weights match it within
    the parity bound (1e-5). A step's ids are the same on the tp and pp peers of a dp rank, so they are taken once."""

    def per_step(run: dict) -> list[list[int]]:
        return [sorted({i for rank in step for i in rank}) for step in zip(*run["ids"], strict=True)]

    whole, resumed = per_step(runs["dp2xtp2-llama"]), per_step(runs["pp2xdp2-llama"])
    assert len(whole) == 12 and resumed == whole[SAVED:], (resumed, whole[SAVED:])
    want, got = runs["dp2xtp2-llama"]["params"], runs["pp2xdp2-llama"]["params"]
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=0, atol=1e-5), (key, (got[key] - value).abs().max())
