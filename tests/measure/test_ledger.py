"""The communication ledger (cuboid.measure.CommLedger): what it reads from the flight recorder per mesh dimension, against
the analytic figure, and its W&B keys in the main job's debug preset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ahead import ahead
from harness import ROOT, run_checked, worker_env

from cuboid.measure.ledger import entries_after, entry_bytes, kind_of, newest_records


def test_kinds_and_bytes_of_flight_recorder_entries() -> None:
    """Backends name ops differently; an all-gather counts its input times the group (gloo records its output with
    the input's shape), the rest their input."""
    assert kind_of("gloo:all_gather") == kind_of("nccl:_allgather_base") == "all_gather"
    assert kind_of("nccl:_reduce_scatter_base") == kind_of("nccl:reduce_scatter_tensor_coalesced") == "reduce_scatter"
    assert kind_of("gloo:all_reduce") == kind_of("nccl:allreduce") == "all_reduce"
    assert kind_of("nccl:send 0->1") == kind_of("gloo:recv") == "send_recv"
    entry = {"input_sizes": [[8, 16, 64]], "input_dtypes": ["BFloat16"], "output_sizes": [[1, 8, 16, 64]]}
    assert entry_bytes(entry, "all_gather", 4) == 4 * 8 * 16 * 64 * 2
    assert entry_bytes(entry, "all_reduce", 4) == 8 * 16 * 64 * 2


def test_each_recorder_ring_keeps_its_own_cursor() -> None:
    """torch's generic recorder (gloo) and NCCL's own number their records apart: a step's new entries are those past
    each ring's cursor, so NCCL's record 3 is new after the generic ring's record 9 was counted."""
    entries = [{"ring": "fr", "record_id": i} for i in range(10)] + [{"ring": "nccl", "record_id": i} for i in range(5)]
    cursors = newest_records(entries[:10] + entries[10:13])
    assert cursors == {"fr": 9, "nccl": 2}
    assert entries_after(entries, cursors) == [{"ring": "nccl", "record_id": 3}, {"ring": "nccl", "record_id": 4}]
    assert entries_after(entries, {}) == entries  # no cursor yet: everything is new


@pytest.fixture(scope="module")
@ahead
def comm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("comm") / "comm.json"
    run_checked([sys.executable, str(ROOT / "scripts" / "bench.py"), "--suite", "comm", "--world", "2", "--out",
                 str(out)], timeout=600, env=worker_env())  # fmt: skip
    return {r["layout"]: r["per_stage"] for r in json.loads(out.read_text())["results"]}


@pytest.mark.slow
def test_fsdp_bytes_equal_the_analytic_figure(comm) -> None:
    """dp2, fp32: forward all-gathers of every unit (root + 4 blocks) and backward ones of the blocks but the last
    (8), gradients all-reduced per unit (gloo has no reduce-scatter) plus the gradient-norm and per-step agreement
    all-reduces on the same (world) group: measured = expected to 0.01%."""
    rows = {(r["dim"], r["kind"]): r for r in comm["dp2"]["pp rank 0"]}
    gather, reduce = rows["dp_shard", "all_gather"], rows["dp_shard", "all_reduce"]
    assert gather["count"] == 8 and gather["ratio"] == pytest.approx(1.0, abs=1e-9)
    assert reduce["count"] == 7 and reduce["ratio"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_tensor_parallel_bytes_equal_the_analytic_figure(comm) -> None:
    """tp2 (sequence + loss parallel), fp32: 18 all-gathers of b s h (4 per block, the embedding's backward, the
    output's input) and 18 reduce-scatters (gloo: all-reduces), the 9 norm-weight gradient all-reduces and loss
    parallel's 3 per-token ones; the gradient norm's and the per-step agreement's scalars share the group (tp is the
    world here). Before the output projection gathered its sequence-sharded input itself, DTensor gathered it inside
    F.linear and again in backward: 19 all-gathers, 20 reductions, ratios 1.056 and 1.116."""
    rows = {(r["dim"], r["kind"]): r for r in comm["tp2"]["pp rank 0"]}
    gather, reduce = rows["tp", "all_gather"], rows["tp", "all_reduce"]
    assert gather["count"] == 18 and gather["ratio"] == pytest.approx(1.0, abs=1e-9)
    assert reduce["count"] == 18 + 9 + 3 + 2 and reduce["ratio"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_pipeline_send_recv_bytes_equal_the_analytic_figure(comm) -> None:
    """pp2 on gloo (whose send/recv torch's flight recorder leaves out: the ledger counts the c10d ops itself): each
    micro-batch's activation forward and its gradient back across the one stage boundary, on both stages."""
    for stage in ("pp rank 0", "pp rank 1"):
        rows = {(r["dim"], r["kind"]): r for r in comm["pp2"][stage]}
        p2p = rows["pp", "send_recv"]
        assert p2p["count"] == 8 and p2p["ratio"] == pytest.approx(1.0, abs=1e-9), (stage, p2p)


@pytest.mark.slow
def test_expert_parallel_all_to_all_bytes_equal_the_analytic_figure(comm) -> None:
    """Cuboid's Llama with 4 experts per block (top-2) at ep2 on 2 ranks: per MoE block the exchange's 5 all-to-alls
    (the pair counts, the rows out and back, both again in backward), their bytes averaged over the ranks equal
    ``4 x top_k x b s h`` plus the counts exactly; the blocks' FSDP units no longer carry the experts."""
    rows = {(r["dim"], r["kind"]): r for r in comm["moe-ep2"]["pp rank 0"]}
    a2a = rows["ep", "all_to_all"]
    assert a2a["count"] == 4 * 5 and a2a["ratio"] == pytest.approx(1.0, abs=1e-9), a2a
    assert rows["dp_shard", "all_gather"]["ratio"] == pytest.approx(1.0, abs=1e-9)
    assert rows["dp_shard", "all_reduce"]["ratio"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_context_parallel_bytes_follow_the_kv_heads(comm) -> None:
    """cp2 (this Llama: 4 query heads, 2 KV heads): per block and micro-batch the model's own K and V (2 heads each,
    not 4 repeated: half the bytes) gathered whole over cp in one collective, in forward and again in backward
    (only this rank's K and V are kept for backward), their gradients reduce-scattered back in one (gloo's is booked
    as an all-reduce; half an all-reduce's bytes), the per-token losses gathered once. cp is the whole world here:
    FSDP's dp_shard_cp and cp are both torch's default group, so FSDP's 8 gathers and 7 reductions are booked
    there too. Measured = expected (the ratio), 8 + 2 x 4 + 1 gathers and 7 + 4 reductions."""
    rows = {(r["dim"], r["kind"]): r for r in comm["cp2"]["pp rank 0"]}
    gather, back = rows["cp", "all_gather"], rows["cp", "all_reduce"]
    assert gather["count"] == 8 + 2 * 4 + 1 and gather["ratio"] == pytest.approx(1.0, abs=1e-9), gather
    assert back["count"] == 7 + 4 and back["ratio"] == pytest.approx(1.0, abs=1e-4), back


@pytest.fixture(scope="module")
@ahead
def comm4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The 4-rank layouts the tests below read, in one bench run (one launch)."""
    out = tmp_path_factory.mktemp("comm4") / "comm4.json"
    run_checked([sys.executable, str(ROOT / "scripts" / "bench.py"), "--suite", "comm", "--world", "4", "--only",
                 "cp2xtp2,moe-ep2-in-dp4", "--out", str(out)], timeout=600, env=worker_env())  # fmt: skip
    return {r["layout"]: r["per_stage"] for r in json.loads(out.read_text())["results"]}


@pytest.mark.slow
def test_under_cp_x_tp_the_logits_are_not_gathered_over_tp(comm4: dict) -> None:
    """cp2 x tp2: loss parallel stays on, so tp's all-gathers are sequence parallel's alone, on this cp rank's half
    of the sequence (the analytic figure has no logits term without pp); cp gathers each tp rank's KV heads; FSDP
    over dp_shard_cp, a group of its own."""
    rows = {(r["dim"], r["kind"]): r for r in comm4["cp2xtp2"]["pp rank 0"]}
    assert rows["tp", "all_gather"]["ratio"] == pytest.approx(1.0, abs=1e-9), rows["tp", "all_gather"]
    for key in (("cp", "all_gather"), ("cp", "all_reduce"), ("dp_shard_cp", "all_gather")):
        assert rows[key]["ratio"] == pytest.approx(1.0, abs=1e-4), (key, rows[key])


@pytest.mark.slow
def test_experts_fsdp_over_efsdp_bytes_equal_the_analytic_figure(comm4: dict) -> None:
    """ep2 inside dp_shard 4: each rank's 2 experts per block are FSDP units over the 2 ranks holding the same
    experts (efsdp), gathered in forward and in backward but the last block's, reduced once each."""
    rows = {(r["dim"], r["kind"]): r for r in comm4["moe-ep2-in-dp4"]["pp rank 0"]}
    assert rows["efsdp", "all_gather"]["count"] == 4 + 3 and rows["efsdp", "all_reduce"]["count"] == 4, rows
    for key in [("efsdp", "all_gather"), ("efsdp", "all_reduce"), ("ep", "all_to_all"), ("dp_shard", "all_gather")]:
        assert rows[key]["ratio"] == pytest.approx(1.0, abs=1e-9), (key, rows[key])


@pytest.mark.slow
def test_debug_preset_logs_the_ledger_to_wandb(tmp_path: Path) -> None:
    from wandb_records import history, read_records

    run_checked([sys.executable, str(ROOT / "scripts" / "train.py"), "--config-name=debug", "trainer.max_steps=4",
                 "trainer.log_every_n_steps=2", f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'c'}",
                 "data.max_bytes=300000", "data.seq_len=64", "data.batch_size=4"], timeout=300, env=worker_env(),
                cwd=tmp_path)  # fmt: skip
    records = read_records(next((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")))
    rows = [r for r in history(records) if "comm/dp_shard/all_gather_MB" in r]
    assert [r["trainer/global_step"] for r in rows] == [2, 4], rows
    assert all(r["comm/dp_shard/all_gather_MB"] > 0 and r["comm/dp_shard/all_gather_count"] > 0 for r in rows)


@pytest.mark.slow
def test_send_recv_counter_survives_a_batch_without_its_end(tmp_path: Path) -> None:
    """A LightningModule whose on_train_batch_start returns -1 ends the epoch without on_train_batch_end: the ledger's
    gloo send/recv counter (a dispatch mode) must not stay entered, nor nest again at the next batch. Before the
    fix: one mode left entered after fit, and every step of the next epoch counted twice (16 instead of 8)."""
    from harness import WORKERS, torchrun

    out = tmp_path / "ledger.json"
    torchrun(2, WORKERS / "ledger_worker.py", str(out))
    got = json.loads(out.read_text())
    assert got["modes_left"] == 0, got
    first, *rest = got["send_recv_counts"]  # the first step also carries the pipeline's one-time shape inference
    assert first > 8 and rest == [8, 8, 8], got
