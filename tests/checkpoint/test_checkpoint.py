"""Sharded checkpoints: exact mid-epoch resume, resharding across layouts, atomic saves, bad input.

A checkpoint is saved by ModelCheckpoint during training (step 6 of 12, or step 17 of 24: mid
epoch 1, with shuffling) and resumed on another layout. Resumed losses must match the
single-process reference with the parity bound (loss rel 1e-5, params abs 1e-5); resumed on the
same layout, each step within relative 1e-6 of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ahead import ahead
from harness import ROOT, WORKERS, SpecRuns, python, run_checked, torchrun, torchrun_cmd, worker_env
from parity_lib import reference_run

from cuboid.checkpoint import CheckpointError, read_model_weights
from cuboid.checkpoint.format import check_loadable

P3D = {"pipeline_parallel": 2, "tensor_parallel": 2}
FULL = {"checkpoint_format": "full"}
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
@ahead
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    out = tmp_path_factory.mktemp("ckpt")
    save = {"max_steps": 7, "save_every": 6}
    launches = [
        (1, [{"name": "single-save", "strategy": {}, **save, "save_dir": str(out / "single")}]),
        (
            8,
            [
                {"name": "3d-save", "strategy": P3D, **save, "save_dir": str(out / "3d")},
                {"name": "3d-from-single", "strategy": P3D, "resume_from": str(out / "single" / "step=6.ckpt")},
                {"name": "3d-full-save", "strategy": {**P3D, **FULL}, **save, "save_dir": str(out / "3d-full")},
            ],
        ),
        (
            4,
            [
                {"name": "dp4-from-3d", "strategy": {}, "resume_from": str(out / "3d" / "step=6.ckpt")},
                {
                    "name": "tp2xdp2-from-3d",
                    "strategy": {"tensor_parallel": 2},
                    "resume_from": str(out / "3d" / "step=6.ckpt"),
                },
                {
                    "name": "pp2xtp2-from-3d",
                    "strategy": P3D,
                    "meta_init": True,
                    "resume_from": str(out / "3d" / "step=6.ckpt"),
                },
                {
                    "name": "tp2xdp2-from-3d-full",
                    "strategy": {"tensor_parallel": 2},
                    "resume_from": str(out / "3d-full" / "step=6.ckpt"),
                },
            ],
        ),
        damage_copies,
        (
            1,
            [
                *[
                    {
                        "name": f"damaged-{kind}",
                        "strategy": {},
                        "resume_from": str(out / "damaged" / kind / "step=6.ckpt"),
                        "expect_error": True,
                    }
                    for kind in DAMAGED
                ],
                {"name": "damaged-auto", "strategy": {}, "resume_from": f"auto:{out / 'fallback'}"},
                {"name": "single-from-3d", "strategy": {}, "resume_from": str(out / "3d" / "step=6.ckpt")},
                {"name": "single-from-3d-full", "strategy": {}, "resume_from": str(out / "3d-full" / "step=6.ckpt")},
                {
                    **save,
                    "name": "weights-only",
                    "strategy": {},
                    "save_dir": str(out / "wo"),
                    "save_weights_only": True,
                },
                {
                    "name": "weights-only-resume",
                    "strategy": {},
                    "resume_from": str(out / "wo" / "step=6.ckpt"),
                    "expect_error": True,
                },
            ],
        ),
        (
            2,
            [
                {
                    "name": "damaged-dp2",
                    "strategy": {},
                    "resume_from": str(out / "damaged" / "odd" / "step=6.ckpt"),
                    "expect_error": True,
                },
                {"name": "exact-uninterrupted", "strategy": {}, "epochs": 2},
                {
                    "name": "exact-first",
                    "strategy": {},
                    "epochs": 2,
                    "max_steps": 18,
                    "save_every": 17,
                    "save_dir": str(out / "exact"),
                },
                {
                    "name": "exact-resumed",
                    "strategy": {},
                    "epochs": 2,
                    "resume_from": str(out / "exact" / "step=17.ckpt"),
                },
                {
                    "name": "link",
                    "strategy": {"async_checkpoint": True},
                    "max_steps": 9,
                    "save_every": 2,
                    "save_dir": str(out / "link"),
                    "save_last": "link",
                    "top_k": 2,
                    "monitor": "train_loss",
                },
                {"name": "link-resumed", "strategy": {}, "resume_from": str(out / "link" / "last.ckpt")},
                {
                    "name": "probe",
                    "strategy": {"tensor_parallel": 2},
                    "max_steps": 3,
                    "async_probe": str(out / "probe"),
                },
            ],
        ),
    ]
    got = SpecRuns(out)
    for launch in launches:
        if callable(launch):
            launch(out)
            continue
        world, specs = launch
        got.launch(world, WORKERS / "parity_worker.py", specs)
    return out, got


# A file of each kind flipped in a copy of the 8-rank checkpoint: (what, the file). "odd": a shard that the second
# of two loading ranks verifies (each rank checks the files of the saving ranks it stands for: 1, 3, 5 and 7).
DAMAGED = {"shard": "__5_0.distcp", "metadata": ".metadata", "lightning": "meta.pt", "rng": "rng/rank3.pt"}


def flip(path: Path) -> None:
    """64 bytes in the middle of ``path`` inverted, its size kept: bit rot, or a torn copy."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def damage_copies(out: Path) -> None:
    """Damaged copies of the 3d save's step 6, and a directory whose newest checkpoint is damaged and whose
    earlier one (the single-process save's step 6) is whole: what ``ckpt_path=auto`` must fall back from."""
    import json
    import os
    import shutil

    source = out / "3d" / "step=6.ckpt"
    names = sorted(json.loads((source / "checksums.json").read_text())["files"])
    odd = next(n for n in names if n.startswith("__") and int(n.split("_")[2]) % 2 == 1)
    for kind, name in {**DAMAGED, "odd": odd}.items():
        copy = out / "damaged" / kind / "step=6.ckpt"
        shutil.copytree(source, copy)
        flip(copy / name)
    shutil.copytree(out / "single" / "step=6.ckpt", out / "fallback" / "step=5.ckpt")
    shutil.copytree(out / "damaged" / "shard" / "step=6.ckpt", out / "fallback" / "step=6.ckpt")
    older = (out / "fallback" / "step=5.ckpt" / "meta.pt").stat().st_mtime - 60
    os.utime(out / "fallback" / "step=5.ckpt" / "meta.pt", (older, older))


@pytest.mark.slow
def test_async_checkpoint_group_is_made_at_setup(runs) -> None:
    """Every rank has the checkpoints' gloo group before the first step, not at the first save hours later."""
    _, got = runs
    assert [r["ckpt_group_at_start"] for r in got["link"]["ranks"]] == [True, True]
    assert [r["ckpt_group_at_start"] for r in got["exact-first"]["ranks"]] == [False, False]  # sync, gloo: none


@pytest.mark.slow
def test_mid_epoch_resume_with_shuffling_is_exact(runs) -> None:
    _, got = runs
    full, resumed = got["exact-uninterrupted"]["losses"], got["exact-resumed"]["losses"]
    assert len(full) == 24 and len(resumed) == 7  # stopped at step 17 of 24: epoch 1, batch 5 of 12
    for step, (a, b) in enumerate(zip(resumed, full[17:], strict=True), start=17):
        assert abs(a - b) <= 1e-6 * abs(b), (step, a, b)
    # and the resumed run saw exactly the samples the uninterrupted one saw in those steps
    assert got["exact-resumed"]["ranks"][0]["seen"] == got["exact-uninterrupted"]["ranks"][0]["seen"][17:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "3d-from-single",
        "dp4-from-3d",
        "tp2xdp2-from-3d",
        "pp2xtp2-from-3d",
        "single-from-3d",
        "tp2xdp2-from-3d-full",
        "single-from-3d-full",
    ],
)
def test_checkpoint_resumes_on_another_layout(name: str, runs) -> None:
    _, got = runs
    ref = reference_run(1)
    losses = got[name]["losses"]
    assert len(losses) == 6  # steps 6..11 of the 12-step epoch
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses[6:], strict=True))
    assert rel <= LOSS_RTOL, f"{name}: relative loss error {rel:.2e}"
    err = max((got[name]["params"][f"model.{k}"] - v).abs().max().item() for k, v in ref.params.items())
    assert err <= PARAM_ATOL, f"{name}: parameter error {err:.2e}"
    # The checkpoint fills every weight: nothing was initialised (pp2xtp2-from-3d builds on meta) or sent from rank 0
    # first. A fresh run of the same layout does both (3d-save: built for real, its tensors sent to their stages).
    made = [r["weights_made"] for r in got[name]["ranks"]]
    assert all(m == {"initialized": 0, "sent": 0} for m in made), (name, made)
    assert got["3d-save"]["ranks"][0]["weights_made"]["sent"] > 0


@pytest.mark.slow
def test_checkpoint_is_sharded_one_file_per_rank(runs) -> None:
    out, _ = runs
    ckpt = out / "3d" / "step=6.ckpt"
    shards = sorted(ckpt.glob("*.distcp"))
    assert [p.name for p in shards] == [f"__{r}_0.distcp" for r in range(8)]
    sizes = [p.stat().st_size for p in shards]
    # nobody gathered the model: each rank wrote its own share, rank 0 about 1/8 of the bytes (measured 0.10;
    # the ranks differ by the small pickled optimizer settings, which DCP writes once, on some ranks)
    assert 0.5 / 8 <= sizes[0] / sum(sizes) <= 1.5 / 8, sizes
    assert max(sizes) <= 2 / 8 * sum(sizes), sizes
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == [f"rank{r}.pt" for r in range(8)]
    assert not [p for p in (out / "3d").iterdir() if p.name.startswith(".")]  # no temporaries left


@pytest.mark.slow
def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    """Rank 1 stops for good after writing its first file of the second save; the job is killed."""
    sentinel = tmp_path / "stalled"
    spec = [
        {
            "name": "crash",
            "strategy": {},
            "max_steps": 12,
            "save_every": 3,
            "save_dir": str(tmp_path / "ck"),
            "stall_on_save": str(sentinel),
        }
    ]
    cmd = torchrun_cmd(2, WORKERS / "parity_worker.py", str(tmp_path), json.dumps(spec))
    proc = subprocess.Popen(
        cmd, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 240
    while not sentinel.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert sentinel.exists(), "the second save never started"
    # Kill the whole job: torchrun starts its workers in sessions of their own, so killing its process group
    # left the stalled rank sleeping for minutes after the test.
    import psutil

    launcher = psutil.Process(proc.pid)
    job = [launcher, *launcher.children(recursive=True)]
    for member in job:
        member.kill()
    _, alive = psutil.wait_procs(job, timeout=30)
    proc.wait(timeout=30)
    assert not alive, alive
    ck = tmp_path / "ck"
    # and the killed run's lock, which the next run in this directory takes over (its process is gone)
    assert sorted(p.name for p in ck.iterdir()) == [".cuboid-run.lock", ".step=6.ckpt.tmp", "step=3.ckpt"]
    check_loadable(ck / "step=3.ckpt")
    with pytest.raises(CheckpointError, match="temporary copy of a save that never finished"):
        check_loadable(ck / ".step=6.ckpt.tmp")
    # the surviving checkpoint resumes and continues like the uninterrupted run
    torchrun(
        2,
        WORKERS / "parity_worker.py",
        str(tmp_path),
        json.dumps([{"name": "after-crash", "strategy": {}, "resume_from": str(ck / "step=3.ckpt")}]),
    )
    losses = torch.load(tmp_path / "after-crash.pt", weights_only=False)["losses"]
    ref = reference_run(1)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses[3:], strict=True)) <= LOSS_RTOL


def test_bad_checkpoints_are_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        check_loadable(tmp_path / "nope.ckpt")
    (tmp_path / "file.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file, not a Cuboid sharded checkpoint"):
        check_loadable(tmp_path / "file.ckpt")
    (tmp_path / "half.ckpt").mkdir()
    (tmp_path / "half.ckpt" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"not a complete Cuboid checkpoint: \.metadata, meta\.pt missing"):
        check_loadable(tmp_path / "half.ckpt")
    # files are checkpoint_format="full" candidates: read, then refused with a reason
    from cuboid.checkpoint.full import load_full

    with pytest.raises(CheckpointError, match="corrupted or incomplete"):
        load_full(tmp_path / "file.ckpt", torch.nn.Linear(2, 2), [])
    torch.save({"epoch": 0}, tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointError, match="without a 'state_dict': not a Lightning checkpoint"):
        load_full(tmp_path / "plain.ckpt", torch.nn.Linear(2, 2), [])
    # a Lightning checkpoint of another model: refused by name, nothing loaded
    torch.save({"state_dict": {"other.weight": torch.zeros(2)}, "epoch": 0}, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match=r"holds another model: 2 parameters missing .*'weight'"):
        load_full(tmp_path / "other.ckpt", torch.nn.Linear(2, 2), [])
    torch.save(
        {"state_dict": {}, "hyper_parameters": {"when": __import__("datetime").date(2026, 1, 1)}}, tmp_path / "p.ckpt"
    )
    with pytest.raises(CheckpointError, match=r"weights-only load refuses \(datetime.date\).*weights_only=False"):
        load_full(tmp_path / "p.ckpt", torch.nn.Linear(2, 2), [])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "full", "full-async", "async-again"])
def test_a_save_keeps_the_weights_of_the_moment_it_was_called(mode: str, runs) -> None:
    """The worker adds 1.0 to every weight right after save_checkpoint returns, then waits for the write."""
    out, _ = runs
    probe = torch.load(out / f"probe-{mode}-probe.pt", weights_only=False)
    saved = read_model_weights(out / f"probe-{mode}")
    for name, before in probe["before"].items():
        assert torch.equal(saved[name], before), name


@pytest.mark.slow
def test_async_saves_reuse_their_host_staging_buffers(runs) -> None:
    """The second async save copies into the same host storages as the first (none freshly allocated): the
    checkpointer keeps one DCP stager (pinned memory on GPUs) across saves."""
    out, _ = runs
    staged = torch.load(out / "probe-async-again-probe.pt", weights_only=False)["staged"]
    assert len(staged) == 2 and staged[0] and staged[0] == staged[1], staged


@pytest.mark.slow
def test_export_writes_one_safetensors_file_without_the_training_layout(runs, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out, got = runs
    target = tmp_path / "model.safetensors"
    run_checked([sys.executable, "-m", "cuboid.export", str(out / "3d" / "step=6.ckpt"), str(target), "--dtype", "bf16"],
                timeout=120)  # fmt: skip
    exported = load_file(target)
    full = read_model_weights(out / "3d" / "step=6.ckpt")
    assert set(exported) == set(full) == set(got["single-from-3d"]["params"])
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[name].to(torch.bfloat16)), name
    bad = python([sys.executable, "-m", "cuboid.export", str(tmp_path / "nope"), str(target)], 120, worker_env())
    assert bad.returncode != 0 and "does not exist" in bad.stderr


def test_export_to_hugging_face_llama_gives_the_same_logits(tmp_path: Path) -> None:
    """A checkpoint of the reference Llama, exported with --hf, loads in transformers' LlamaForCausalLM
    and predicts what our model predicts (same rotate-half rotary layout: only the names change)."""
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    from cuboid.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
    torch.manual_seed(0)
    ours = Llama(cfg).eval()
    ckpt = tmp_path / "step=1.ckpt"
    dcp.save({"model": {f"model.{k}": v for k, v in ours.state_dict().items()}}, checkpoint_id=ckpt, no_dist=True)
    torch.save({}, ckpt / "meta.pt")
    (tmp_path / "cfg.yaml").write_text(
        "\n".join(f"{f.name}: {json.dumps(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg))
    )
    run_checked(
        [
            sys.executable,
            "-m",
            "cuboid.export",
            "export",  # the form earlier releases documented (`python -m cuboid.checkpoint export ...`) still parses
            str(ckpt),
            str(tmp_path / "hf"),
            "--hf",
            str(tmp_path / "cfg.yaml"),
        ],
        timeout=120,
    )
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_full_checkpoint_is_one_file_equal_to_the_sharded_one(runs) -> None:
    """The same 3D run saved both ways: one file on rank 0, holding exactly the sharded checkpoint's
    weights and optimizer state, readable by plain torch (weights-only) and Lightning."""
    import torch.distributed.checkpoint as dcp
    from parity_lib import LlamaModule
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out, _ = runs
    assert sorted(p.name for p in (out / "3d-full").iterdir()) == ["step=6.ckpt"]  # no temporaries, one file
    full_path, sharded_path = out / "3d-full" / "step=6.ckpt", out / "3d" / "step=6.ckpt"
    full = torch.load(full_path, map_location="cpu", weights_only=True)
    sharded = read_model_weights(sharded_path)
    assert set(full["state_dict"]) == set(sharded)
    for name, tensor in sharded.items():
        assert torch.equal(full["state_dict"][name], tensor), name
    # the optimizer state (flattened, by parameter name) equals the sharded checkpoint's, entry by entry
    meta = dcp.FileSystemReader(sharded_path).read_metadata().state_dict_metadata
    stored = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.startswith("optimizer_0") and isinstance(m, TensorStorageMetadata)
    }
    dcp.load(stored, checkpoint_id=sharded_path, no_dist=True)
    # The file holds it in torch.optim's own format (what plain Lightning resumes): by position, in the whole
    # model's parameter order although this pp2 run's ranks each held half of the parameters.
    optimizer = full["optimizer_states"][0]
    names = [n for n, _ in LlamaModule().named_parameters()]
    assert [g["params"] for g in optimizer["param_groups"]] == [list(range(len(names)))]
    by_name = {
        f"optimizer_0.state.{names[i]}.{k}": v for i, entry in optimizer["state"].items() for k, v in entry.items()
    }
    assert {k for k, v in by_name.items() if torch.is_tensor(v)} == set(stored)
    for key, value in stored.items():
        assert torch.equal(by_name[key], value), key
    assert len(full["cuboid"]["rng"]) == 8 and full["global_step"] == 6
    module = LlamaModule.load_from_checkpoint(full_path, map_location="cpu")
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, sharded[name]), name


@pytest.mark.slow
def test_save_last_link_points_at_the_newest_complete_checkpoint(runs) -> None:
    """ModelCheckpoint(save_last="link", save_top_k=2) with async saves: `last` is a link to a complete
    checkpoint kept by top-k, no temporaries or dangling links are left, and resuming from it continues."""
    out, got = runs
    # whenever a step started, `last` pointed at a complete checkpoint (Lightning alone links before an async
    # save has finished, and deletes `last` before it links)
    assert got["link"]["link_targets_complete"] and all(got["link"]["link_targets_complete"])
    link_dir = out / "link"
    last = link_dir / "last.ckpt"
    assert last.is_symlink() and last.exists()
    kept = sorted(p.name for p in link_dir.iterdir() if not p.is_symlink())
    assert len(kept) == 2 and not [p for p in kept if p.startswith(".")], kept
    assert os.readlink(last) in kept
    check_loadable(last)
    step = int(os.readlink(last).split("=")[1].split(".")[0])
    assert step == max(int(k.split("=")[1].split(".")[0]) for k in kept)
    ref = reference_run(1)
    losses = got["link-resumed"]["losses"]
    assert len(losses) == 12 - step
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses[step:], strict=True)) <= LOSS_RTOL


def test_link_replaces_last_atomically_and_defers_deleting_its_target(tmp_path: Path) -> None:
    """The link update itself: a real `last` directory (from save_last=True) is replaced by the link, and a
    top-k deletion of the checkpoint `last` still points to waits until the link has moved."""
    from cuboid import CuboidStrategy

    strategy = CuboidStrategy()
    for name in ("step=2.ckpt", "step=4.ckpt", "last.ckpt"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.pt").write_bytes(b"x")
    last = tmp_path / "last.ckpt"
    strategy.checkpointer.link(None, tmp_path / "step=2.ckpt", last)
    assert last.is_symlink() and os.readlink(last) == "step=2.ckpt"
    strategy.remove_checkpoint(tmp_path / "step=2.ckpt")  # top-k drops it while `last` still points there
    assert (tmp_path / "step=2.ckpt").is_dir()
    strategy.checkpointer.link(None, tmp_path / "step=4.ckpt", last)
    assert os.readlink(last) == "step=4.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=4.ckpt"]
    strategy.remove_checkpoint(last)  # removing a link never touches its target
    assert (tmp_path / "step=4.ckpt").is_dir() and not last.exists()


@pytest.mark.slow
def test_save_weights_only_writes_the_model_alone(runs) -> None:
    """ModelCheckpoint(save_weights_only=True): no optimizer shards (a smaller checkpoint with the same weights),
    and resuming training from it stops with Lightning's own message, not a misleading read error."""
    import torch.distributed.checkpoint as dcp

    out, got = runs
    keys = set(dcp.FileSystemReader(out / "wo" / "step=6.ckpt").read_metadata().state_dict_metadata)
    assert keys and all(k.startswith("model.") for k in keys)
    weights = read_model_weights(out / "wo" / "step=6.ckpt")
    for name, tensor in read_model_weights(out / "single" / "step=6.ckpt").items():
        assert torch.equal(weights[name], tensor), name
    assert "save_weights_only" in got["weights-only-resume"]["error"], got["weights-only-resume"]


@pytest.mark.slow
def test_the_resume_bench_initializes_nothing_when_a_checkpoint_fills_the_weights(tmp_path: Path) -> None:
    """``scripts/bench.py --suite resume`` (the debug model, dp2): resumed as before, rank 0 initializes every piece
    of the meta-built model and the checkpoint then overwrites them; resumed now, nothing is initialized or sent."""
    out = tmp_path / "resume.json"
    bench = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--suite", "resume", "--model", "debug"]
    run_checked([*bench, "--out", str(out)], timeout=600, env=worker_env())
    rows = {row["mode"]: row for row in json.loads(out.read_text())["results"]}
    assert rows["initialize_then_load"]["initialized"] > 0
    assert (rows["load_only"]["initialized"], rows["load_only"]["sent"]) == (0, 0)


def test_a_damaged_file_of_any_kind_stops_the_load_naming_it(runs) -> None:
    """Every file a save writes has its CRC-32 in ``checksums.json``. 64 bytes flipped in one file of a copy (a
    DCP shard of model and optimizer state, DCP's ``.metadata``, Lightning's ``meta.pt``, a rank's RNG state), and
    the load stops before any weight is read, naming the file and the checkpoint. Two loading ranks check half the files each; a file the second one checks is found."""
    out, got = runs
    for kind, name in {**DAMAGED, "dp2": None}.items():
        error = got[f"damaged-{kind}"]["error"]
        assert error and error.startswith("CheckpointDamaged:"), (kind, error)
        assert "damaged" in error and "step=6.ckpt" in error and "the save wrote" in error, (kind, error)
        if name is not None:
            assert f"{name}: xxHash3" in error, (kind, error)
    listed = json.loads((out / "3d" / "step=6.ckpt" / "checksums.json").read_text())["files"]
    on_disk = {str(p.relative_to(out / "3d" / "step=6.ckpt")) for p in (out / "3d" / "step=6.ckpt").rglob("*")
               if p.is_file() and p.name != "checksums.json"}  # fmt: skip
    assert set(listed) == on_disk and len(on_disk) >= 8 + 8 + 2, sorted(on_disk)


def test_auto_resume_falls_back_past_a_damaged_checkpoint_and_keeps_it(runs) -> None:
    """``ckpt_path=auto`` (the parity worker's ``auto:`` as the main job's): the newest checkpoint is damaged, so
    the newest earlier one that verifies is loaded, with a warning that names the damaged one, which stays on
    disk; training goes on from there as a resume from that checkpoint does."""
    out, got = runs
    run = got["damaged-auto"]
    facts = run["ranks"][0]
    assert facts["resumed_from"].endswith("fallback/step=6.ckpt"), facts["resumed_from"]
    (warning,) = set(facts["damaged_warnings"])
    assert "fallback/step=6.ckpt is damaged" in warning and "fallback/step=5.ckpt" in warning, warning
    assert (out / "fallback" / "step=6.ckpt" / "checksums.json").is_file()
    assert run["losses"] == pytest.approx(got["single-from-3d"]["losses"], rel=1e-5)


def test_each_rank_hashes_the_files_it_wrote() -> None:
    """A save's ranks hash their own files (still in their host's page cache; on a shared file system no rank reads
    another node's files), rank 0 the shared ones too; a load on fewer ranks takes the saving ranks' files by
    rank modulo its size, and one on more ranks than the save had spreads every file over its ranks."""
    from cuboid.checkpoint.sharded import _share

    names = sorted([".metadata", "meta.pt", *(f"__{r}_{k}.distcp" for r in range(4) for k in range(2)),
                    *(f"rng/rank{r}.pt" for r in range(4))])  # fmt: skip
    assert _share(names, 0, 4) == [".metadata", "__0_0.distcp", "__0_1.distcp", "meta.pt", "rng/rank0.pt"]
    assert _share(names, 3, 4) == ["__3_0.distcp", "__3_1.distcp", "rng/rank3.pt"]
    assert _share(names, 1, 2) == ["__1_0.distcp", "__1_1.distcp", "__3_0.distcp", "__3_1.distcp", "rng/rank1.pt",
                                   "rng/rank3.pt"]  # fmt: skip
    shares = [_share(names, r, 8) for r in range(8)]
    assert sorted(sum(shares, [])) == names and max(map(len, shares)) == 2, shares


def test_a_checkpoint_with_crc32_checksums_still_verifies_and_names_a_damaged_file(tmp_path: Path) -> None:
    """Cuboid's first checksums were CRC-32s (``"algorithm": "crc32"``): such a checkpoint verifies with them."""
    import zlib

    from cuboid.checkpoint.sharded import CheckpointDamaged, verify_checkpoint

    files = {"__0_0.distcp": b"shard" * 1000, ".metadata": b"meta", "empty": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    listing = {name: [len(data), f"{zlib.crc32(data):08x}"] for name, data in files.items()}
    (tmp_path / "checksums.json").write_text(json.dumps({"algorithm": "crc32", "files": listing}))
    verify_checkpoint(tmp_path)
    flip(tmp_path / "__0_0.distcp")
    with pytest.raises(CheckpointDamaged, match=r"__0_0.distcp: CRC-32 [0-9a-f]{8}, the save wrote"):
        verify_checkpoint(tmp_path)


def test_a_checkpoint_without_checksums_loads_with_a_warning_and_a_whole_one_verifies(tmp_path: Path) -> None:
    """Written before Cuboid kept checksums (or by another tool): no ``checksums.json``, so it cannot be verified,
    and says so; once they are written, the same files verify, and a missing one is named."""
    from cuboid.checkpoint.sharded import CheckpointDamaged, verify_checkpoint, write_checksums

    (tmp_path / "rng").mkdir()
    for name in ("__0_0.distcp", ".metadata", "rng/rank0.pt"):
        (tmp_path / name).write_bytes(name.encode() * 1000)
    with pytest.warns(UserWarning, match="cannot be verified"):
        verify_checkpoint(tmp_path)
    write_checksums(tmp_path)
    verify_checkpoint(tmp_path)
    (tmp_path / "rng" / "rank0.pt").unlink()
    with pytest.raises(CheckpointDamaged, match=r"rng/rank0.pt: missing"):
        verify_checkpoint(tmp_path)
