"""Runs that would hang: a rank stuck outside any collective, uneven batch counts. Each must end on every rank,
with a message, and leave no process behind.

The stuck rank runs under a real torchrun, watched for every process below it (the watchdog's kill is what it
tests); the uneven counts are Cuboid's checks inside the Trainer, so their ranks are forked from the suite's fork
server (``harness.launch``: each rank a real process in a TorchElastic environment, without the imports)."""

from __future__ import annotations

import json

import pytest
from harness import WORKERS, launch, launch_and_watch, running, torchrun_cmd


def _fault_run(tmp_path, scenario: str, nprocs: int, timeout: float = 150) -> tuple[int, str, float, dict[int, dict]]:
    cmd = torchrun_cmd(nprocs, WORKERS / "fault_worker.py", str(tmp_path), scenario)
    code, out, closed, seen = launch_and_watch(cmd, timeout=timeout)
    assert not [pid for pid in seen if running(pid)], seen
    return code, out, closed, _rank_facts(tmp_path, nprocs)


def _forked_run(tmp_path, scenario: str, nprocs: int = 2) -> tuple[list[int | None], str, dict[int, dict]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    ran = launch(nprocs, WORKERS / "fault_worker.py", str(tmp_path), scenario, timeout=150)
    assert not ran.timed_out, ran.message()
    return ran.codes, ran.out, _rank_facts(tmp_path, nprocs)


def _rank_facts(tmp_path, nprocs: int) -> dict[int, dict]:
    """What each rank that returned wrote (``rank<r>.json``), by rank."""
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nprocs)
            if (tmp_path / f"rank{r}.json").exists()}  # fmt: skip


@pytest.mark.alone  # its seconds are bounded
@pytest.mark.slow
def test_a_stuck_rank_times_out_with_the_collective_its_dimension_and_the_rank_named(tmp_path) -> None:
    """dp2 x tp2, timeout 4 s: rank 1 sleeps in training_step (alive, heartbeating). Its tp peer (rank 0) and dp
    peer (rank 3) time out in a collective over 'tp' and 'dp_shard' naming rank 1 and the line it is stuck on;
    every process, rank 1 included, is gone within timeout + 12 s. Without the timeouts on the mesh's groups
    (torch gives them 30 min) this waits to the test's limit; without the report the error is gloo's "Timed out
    waiting 4000ms for recv operation", which names neither."""
    code, out, closed, ranks = _fault_run(tmp_path, "hang", 4)
    stalled = json.loads((tmp_path / "stall.json").read_text())["time"]
    assert code != 0
    assert closed - stalled < 4 + 12, (closed - stalled, out[-4000:])
    assert 1 not in ranks  # the stuck rank was stopped by its watchdog, from the store's mark
    assert "Cuboid (rank 1): a collective timed out" in out and "exit code 3" in out, out[-4000:]
    source = (WORKERS / "fault_worker.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if text.strip().startswith("time.sleep(120)"))
    stuck_line = f"fault_worker.py:{line} in training_step (time.sleep(120)"
    assert stuck_line in out, out[-4000:]
    zero, three = ranks[0]["message"], ranks[3]["message"]
    assert "Cuboid: rank 0: all_reduce over mesh dimension 'tp' (ranks [0, 1]" in zero, zero
    assert "Cuboid: rank 3: all_gather over mesh dimension 'dp_shard' (ranks [1, 3]" in three, three
    for message in (zero, three):
        assert "did not complete within 4 s" in message and "Rank 1 never joined it" in message, message
        assert stuck_line in message, message
        assert "flight_recorder/cuboid_rank_<r>." in message, message  # beside torch's own rank_<r>, never over it
    assert sorted(p.name for p in (tmp_path / "flight_recorder").iterdir()) == [f"cuboid_rank_{r}" for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("scenario,stage,counts", [("uneven_train", "training", "rank 0: 6, rank 1: 5"),
                                                    ("uneven_val", "validation", "rank 0: 3, rank 1: 4")])  # fmt: skip
def test_uneven_batch_counts_stop_every_rank_before_any_step(tmp_path, scenario: str, stage: str, counts: str) -> None:
    """Loaders with a length but different counts per rank (no DistributedSampler): every rank stops before the
    first step with the counts and the fixes. Without the check, training ran 6 steps on rank 0 and 5 on rank 1:
    rank 1 returned "successfully" and rank 0 failed in its extra step (checked by hand)."""
    codes, out, ranks = _forked_run(tmp_path, scenario)
    assert all(codes), out[-4000:]
    for rank in (0, 1):
        facts = ranks[rank]
        assert facts["exception"] == "UnevenBatchesError", facts
        assert f"{stage}: the ranks have different numbers of batches ({counts})" in facts["message"], facts
        assert facts["global_step"] == 0 and facts["seen"] == {"train": 0, "val": 0}, facts


@pytest.mark.slow
def test_loaders_without_a_length_end_together_when_one_rank_runs_out(tmp_path) -> None:
    """IterableDatasets: training 5 batches on rank 0 and 7 on rank 1, 2 epochs; validation 3 and 2. Every epoch
    ends after 5 steps and every validation after 2 batches, on both ranks, with a warning. Without the per-batch
    agreement rank 1 waits in its 6th step until the timeout (checked by hand)."""
    codes, out, ranks = _forked_run(tmp_path, "iterable")
    assert not any(codes), out[-4000:]
    for rank in (0, 1):
        assert ranks[rank]["exception"] is None, ranks[rank]
        assert ranks[rank]["global_step"] == 10 and ranks[rank]["seen"] == {"train": 10, "val": 4}, ranks[rank]
    assert "training: a rank's data loader (it has no length) ran out before the others'" in out
    assert "validation: a rank's data loader (it has no length) ran out before the others'" in out


@pytest.mark.slow
def test_peers_given_different_batches_stop_before_the_first_step_and_the_named_fix_trains(tmp_path) -> None:
    """A stream the module deals over every rank by hand (``dist.get_rank()``, as users shard an IterableDataset) at
    dp2 x tp2: the tp peers would train on different samples. Every rank stops before the first step, naming each
    data-parallel rank's peers and the fix; the same stream dealt as the message says
    (``trainer.strategy.distributed_sampler_kwargs``) trains at tp2 with both ranks on the same samples. Without the
    check, the first run trained its 3 steps with no error, its first batch ids 0, 4 on rank 0 and 1, 5 on rank 1
    (checked by hand)."""
    codes, out, ranks = _forked_run(tmp_path / "by_rank", "peers_by_rank", 4)
    assert all(codes), out[-4000:]
    for rank in range(4):
        facts = ranks[rank]
        assert facts["exception"] == "PeerBatchesDiffer", facts
        assert facts["global_step"] == 0 and facts["seen"] == {"ids": []}, facts
        message = facts["message"]
        assert "training, epoch 0: ranks that must read the same batch were given different ones" in message, message
        assert "data-parallel rank 0: rank 0 / rank 1; data-parallel rank 1: rank 2 / rank 3" in message, message
        assert "Deal your data over the 2 data-parallel ranks only" in message, message
    codes, out, ranks = _forked_run(tmp_path / "by_dp", "peers_by_dp", 2)
    assert not any(codes), out[-4000:]
    assert ranks[0]["exception"] is None and ranks[0]["global_step"] == 3, ranks[0]
    assert ranks[0]["seen"] == ranks[1]["seen"] == {"ids": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15],
                                                            [16, 17, 18, 19, 20, 21, 22, 23]]}, ranks  # fmt: skip


@pytest.mark.slow
def test_random_crops_drawn_in_workers_agree_on_peers_and_differ_across_data_parallel_ranks(tmp_path) -> None:
    """``seed_everything(workers=True)`` at dp2 x tp2, each sample a random roll drawn in a DataLoader worker:
    Lightning seeds workers by the global rank, so tp peers drew different rolls and the peer check stopped the run
    (checked by hand before the fix: PeerBatchesDiffer on every rank, step 0). Cuboid seeds them by the
    data-parallel rank: the 3 steps train, peers see the same rolls, the two data-parallel ranks different ones; and
    what each step draws from the main process's generator agrees on peers too."""
    codes, out, ranks = _forked_run(tmp_path, "crops", 4)
    assert not any(codes), out[-4000:]
    assert all(ranks[r]["exception"] is None and ranks[r]["global_step"] == 3 for r in range(4)), ranks
    seen = [ranks[r]["seen"] for r in range(4)]
    assert seen[0] == seen[1] and seen[2] == seen[3], seen
    assert seen[0]["shifts"] != seen[2]["shifts"], seen
    assert len({s for batch in seen[0]["shifts"] for s in batch}) > 4, seen  # random rolls, not one offset


def test_a_batch_fingerprint_reads_every_tensors_bytes_shape_and_place_and_the_values_around_them() -> None:
    """cuboid.job.peer_batches.fingerprint, which peers compare: equal contents give one digest however the tensors
    are laid out in memory; any change of a byte, a dtype, a shape, the order of tensors, a key or a plain value gives
    another (the bytes are joined before one host copy, so a split moved between tensors must still count)."""
    import torch

    from cuboid.job.peer_batches import fingerprint

    ids = torch.arange(12).reshape(3, 4)
    base = fingerprint({"ids": ids, "mask": ids > 3, "name": "a", "n": 1})
    assert fingerprint({"n": 1, "name": "a", "mask": ids > 3, "ids": ids.t().contiguous().t()}) == base
    changed = [
        {"ids": ids.clone().index_put_((torch.tensor(2), torch.tensor(3)), torch.tensor(99)), "mask": ids > 3,
         "name": "a", "n": 1},
        {"ids": ids.int(), "mask": ids > 3, "name": "a", "n": 1},
        {"ids": ids.reshape(4, 3), "mask": ids > 3, "name": "a", "n": 1},
        {"ids": ids, "mask": ids > 4, "name": "a", "n": 1},
        {"ids": ids, "mask": ids > 3, "name": "b", "n": 1},
        {"ids": ids, "mask": ids > 3, "name": "a", "n": 2},
        {"tokens": ids, "mask": ids > 3, "name": "a", "n": 1},
    ]  # fmt: skip
    digests = [fingerprint(batch) for batch in changed]
    assert base not in digests and len(set(digests)) == len(digests)
    a, b = torch.arange(6), torch.arange(6, 12)
    assert fingerprint((a, b)) != fingerprint((b, a))
    assert fingerprint((a[:4], torch.arange(4, 12))) != fingerprint((a, b))
    assert fingerprint(torch.empty(0, 3)) != fingerprint(torch.empty(3, 0))
