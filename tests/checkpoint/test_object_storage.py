"""Checkpoints on object storage: ``s3://`` against a local S3 server the tests start and stop (moto's standalone
server, the one s3fs's own test suite runs against), through s3fs, as on a cluster whose checkpoints live in S3.

One worker run saves through ``ModelCheckpoint(dirpath="s3://...")`` (sharded and async, with ``save_last``; the
full format), another has a rank killed in the middle of its second save; then: resumed on another layout, from
``auto`` (which must pass over the killed save), from a copy with one object damaged (refused by name, or passed
over by ``auto``), from ``last``, and exported by ``python -m cuboid.export`` from the URL. Resumed losses and
weights match the one-process reference within the parity bound (1e-5). The server's state is read inside the
fixture; the server stops with it, and a test checks no process of it is left.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ahead import ahead
from harness import WORKERS, SpecRuns, python, worker_env
from parity_lib import LOSS_RTOL, PARAM_ATOL, parity_errors, reference_run

from cuboid.checkpoint.sharded import checkpoints_newest_first, is_sharded_checkpoint
from cuboid.storage import to_path

BUCKET = "ckpt"
ROOT = f"s3://{BUCKET}"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server() -> Iterator[tuple[dict[str, str], object]]:
    """moto's S3 server on a free loopback port, a bucket in it; yields the environment that points a process at
    it and an s3fs file system on it. Stopped on the way out, whatever happened."""
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", **KEYS}
        fs = S3FileSystem(
            key=KEYS["AWS_ACCESS_KEY_ID"], secret=KEYS["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True,
            use_listings_cache=False, client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]},
        )  # fmt: skip
        import requests

        requests.post(f"{env['AWS_ENDPOINT_URL']}/moto-api/reset", timeout=30)  # moto's state is per process
        fs.mkdir(BUCKET)
        yield env, fs
    finally:
        server.stop()


def flip(fs: object, key: str) -> None:
    """64 bytes in the middle of an object inverted, its size kept (bit rot, a torn copy)."""
    data = bytearray(fs.cat_file(key))  # type: ignore[attr-defined]
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(255 - b for b in data[mid : mid + 64])
    fs.pipe_file(key, bytes(data))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
@ahead
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("s3")
    got = SpecRuns(out)
    seen: dict = {"runs": got}
    with s3_server() as (env, fs):
        save = {"env": env, "max_steps": 7, "save_every": 3}
        got.launch(2, WORKERS / "parity_worker.py", [
            {**save, "name": "s3-async-save", "strategy": {"async_checkpoint": True}, "save_dir": f"{ROOT}/async",
             "save_last": True},
            {**save, "name": "s3-full-save", "strategy": {"checkpoint_format": "full"}, "save_dir": f"{ROOT}/full"},
        ])  # fmt: skip
        # rank 0 dies in the second save (step 6) once DCP's metadata is written: no checksums, no marker
        seen["killed"] = got.launch(2, WORKERS / "parity_worker.py", [
            {**save, "name": "s3-killed", "strategy": {}, "save_dir": f"{ROOT}/killed", "die_on_save": True}
        ], timeout=300)  # fmt: skip
        seen["killed_objects"] = sorted(fs.find(f"{BUCKET}/killed/step=6.ckpt"))
        options = {"key": KEYS["AWS_ACCESS_KEY_ID"], "secret": KEYS["AWS_SECRET_ACCESS_KEY"],
                   "client_kwargs": {"endpoint_url": env["AWS_ENDPOINT_URL"]}}  # fmt: skip
        killed = to_path(f"{ROOT}/killed", options)  # (the storage options given here, not this process's environment)
        seen["complete"] = [str(found) for found in checkpoints_newest_first(killed)]
        seen["step6_complete"] = is_sharded_checkpoint(killed / "step=6.ckpt")
        seen["listing"] = {name: sorted(fs.find(f"{BUCKET}/{name}")) for name in ("async", "full")}
        for step in (3, 6):
            fs.copy(f"{BUCKET}/async/step={step}.ckpt", f"{BUCKET}/damaged/step={step}.ckpt", recursive=True)
        flip(fs, f"{BUCKET}/damaged/step=6.ckpt/__1_0.distcp")
        got.launch(4, WORKERS / "parity_worker.py", [
            {"env": env, "name": "s3-tp2xdp2-from-async", "strategy": {"tensor_parallel": 2},
             "resume_from": f"{ROOT}/async/step=6.ckpt"},
            {"env": env, "name": "s3-dp4-from-full", "strategy": {}, "resume_from": f"{ROOT}/full/step=6.ckpt"},
        ])  # fmt: skip
        got.launch(1, WORKERS / "parity_worker.py", [
            {"env": env, "name": "s3-auto-past-killed", "strategy": {}, "resume_from": f"auto:{ROOT}/killed"},
            {"env": env, "name": "s3-damaged", "strategy": {}, "resume_from": f"{ROOT}/damaged/step=6.ckpt",
             "expect_error": True},
            {"env": env, "name": "s3-damaged-auto", "strategy": {}, "resume_from": f"auto:{ROOT}/damaged"},
            {"env": env, "name": "s3-from-last", "strategy": {}, "resume_from": f"{ROOT}/async/last.ckpt"},
        ])  # fmt: skip
        exported = out / "exported.safetensors"
        ran = python([sys.executable, "-m", "cuboid.export", f"{ROOT}/async/step=6.ckpt", str(exported)],
                     env=worker_env(**env))  # fmt: skip
        seen["export"] = (ran.returncode, ran.stdout + ran.stderr, exported)
        fs.get(f"{BUCKET}/async/step=6.ckpt", str(out / "local-step6"), recursive=True)
        seen["local_copy"] = out / "local-step6"
    seen["server_threads"] = [t.name for t in threading.enumerate() if "moto" in t.name.lower()]
    return seen


@pytest.mark.slow
def test_a_sharded_async_save_to_s3_resumes_on_another_layout(stored) -> None:
    """dp2, async, into ``s3://ckpt/async`` by ModelCheckpoint; resumed at tp2 x dp2: steps 7-12 of one process."""
    listing = stored["listing"]["async"]
    for step in (3, 6):
        names = {key.split(f"step={step}.ckpt/")[1] for key in listing if f"/step={step}.ckpt/" in key}
        assert {".metadata", "meta.pt", "checksums.json", ".cuboid-complete", "__0_0.distcp", "__1_0.distcp"} <= names
    assert any("/last.ckpt/.cuboid-complete" in key for key in listing)  # saved again under one name, committed
    got = stored["runs"]["s3-tp2xdp2-from-async"]
    rel, err = parity_errors(got, reference_run(1), steps=slice(6, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_a_full_file_on_s3_is_one_object_and_resumes_on_four_ranks(stored) -> None:
    assert sorted(stored["listing"]["full"]) == [f"{BUCKET}/full/step={s}.ckpt" for s in (3, 6)]
    rel, err = parity_errors(stored["runs"]["s3-dp4-from-full"], reference_run(1), steps=slice(6, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_a_save_killed_midway_leaves_nothing_auto_would_pick(stored) -> None:
    """Rank 0 was killed right after DCP wrote ``.metadata`` in the second save: step 6 holds every shard, DCP's
    metadata and Lightning's ``meta.pt`` (complete by DCP's and Lightning's rule), but no checksums and no commit
    marker; ``auto`` resumes from step 3, the newest committed one: steps 4-12 of one process."""
    assert not stored["killed"].ok
    names = {key.rsplit("/step=6.ckpt/", 1)[1] for key in stored["killed_objects"]}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= names, names
    assert ".cuboid-complete" not in names and "checksums.json" not in names, names
    assert stored["complete"] == [f"{ROOT}/killed/step=3.ckpt"] and stored["step6_complete"] is False
    got = stored["runs"]["s3-auto-past-killed"]
    assert got["ranks"][0]["resumed_from"] == f"{ROOT}/killed/step=3.ckpt"
    rel, err = parity_errors(got, reference_run(1), steps=slice(3, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_a_damaged_object_is_refused_by_name_and_auto_falls_back(stored) -> None:
    error = stored["runs"]["s3-damaged"]["error"]
    assert error.startswith("CheckpointDamaged") and "__1_0.distcp" in error and "xxHash3" in error, error
    assert f"{ROOT}/damaged/step=6.ckpt" in error
    got = stored["runs"]["s3-damaged-auto"]
    assert any("Resumed from" in w and "step=3.ckpt" in w for w in got["ranks"][0]["damaged_warnings"])
    rel, err = parity_errors(got, reference_run(1), steps=slice(3, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_last_on_s3_resumes_from_the_last_save(stored) -> None:
    """``save_last=True``: ``last.ckpt`` written again at each save (steps 3 and 6) under one name: the copy of
    step 6, committed again; resumed, steps 7-12 of one process."""
    rel, err = parity_errors(stored["runs"]["s3-from-last"], reference_run(1), steps=slice(6, None))
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)


@pytest.mark.slow
def test_export_reads_a_checkpoint_from_its_url(stored) -> None:
    from safetensors.torch import load_file

    from cuboid import read_model_weights

    code, out, exported = stored["export"]
    assert code == 0, out
    weights, local = load_file(str(exported)), read_model_weights(stored["local_copy"])
    assert set(weights) == set(local) and all(torch.equal(weights[k], local[k]) for k in local)


@pytest.mark.slow
def test_the_server_is_gone_after_the_fixture(stored) -> None:
    assert stored["server_threads"] == []


def test_the_run_lock_on_s3_is_taken_once_and_released() -> None:
    """The run lock as an object: created only if absent (a conditional PUT), a live holder refused by name,
    removed at the end."""
    import os

    from cuboid.job import RunDirectoryBusy
    from cuboid.job.run_lock import LOCK_NAME, RunLock

    with s3_server() as (env, fs):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            first = RunLock(f"{ROOT}/locked")
            first.acquire()
            assert fs.exists(f"{BUCKET}/locked/{LOCK_NAME}")
            other = RunLock(f"{ROOT}/locked")
            other.me = {**other.me, "host": "elsewhere", "pid": 1, "job": "slurm:2"}
            with pytest.raises(RunDirectoryBusy, match="is in use by another run .*host "):
                other.acquire()
            first.release()
            assert not fs.exists(f"{BUCKET}/locked/{LOCK_NAME}")
            other.acquire()  # free again
            other.release()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_urls_stay_urls_and_a_local_path_refuses_storage_options(tmp_path: Path) -> None:
    from cuboid.storage import RemotePath, is_remote, to_path

    assert is_remote("s3://b/run") and not is_remote(str(tmp_path)) and not is_remote(f"file://{tmp_path}")
    assert to_path(f"file://{tmp_path}") == tmp_path
    remote = to_path("memory://bucket/run/step=3.ckpt")
    assert isinstance(remote, RemotePath) and str(remote) == "memory://bucket/run/step=3.ckpt"
    assert remote.name == "step=3.ckpt" and str(remote.parent / "last.ckpt") == "memory://bucket/run/last.ckpt"
    with pytest.raises(TypeError, match="storage_options=.* local path"):
        to_path(tmp_path, {"anon": True})
