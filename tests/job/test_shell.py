"""The user's shell: scripts/train.py (Hydra), W&B offline runs read back, sweeps, SLURM, bad input.

Each test runs the real script as a subprocess on real local text (a slice of the Python
standard library's sources) with real process groups (gloo) and a real offline W&B run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import ROOT, free_port, interpreter, python, run_checked, worker_env
from wandb_records import config, history, read_records

from cuboid.data import TokenDataModule, prepare_tokens
from cuboid.models import CausalLM, LlamaConfig

TRAIN = str(ROOT / "scripts" / "train.py")
SMALL = ["data.max_bytes=300000", "data.seq_len=64", "data.batch_size=4"]


def train(tmp: Path, *overrides: str, timeout: float = 300, env: dict | None = None) -> str:
    sweep = ["-m"] if "-m" in overrides else []
    flags = [o for o in overrides if o.startswith("--config-name=")]  # before the overrides (argparse)
    rest = [o for o in overrides if o != "-m" and o not in flags]
    args = [*sweep, *flags, f"data.cache_dir={tmp / 'cache'}", *SMALL, *rest]
    if not sweep and not any(o.startswith("hydra.run.dir=") for o in overrides):
        args.append(f"hydra.run.dir={tmp / 'run'}")
    return run_checked([sys.executable, TRAIN, *args], timeout=timeout, env=env, cwd=tmp)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def sweep_jobs(sweep: Path) -> list[Path]:
    """The job directories of a Hydra sweep (0, 1, ...)."""
    return sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())


def debug_task(tmp: Path) -> tuple[CausalLM, TokenDataModule]:
    """The debug model and data exactly as the job builds them (same seed, same token file)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "debug.yaml"))
    cfg.pop("_target_")
    task = CausalLM(model=LlamaConfig(**cfg), init_seed=1234)
    task.configure_model()
    data = TokenDataModule(cache_dir=str(tmp / "cache"), max_bytes=300000, seq_len=64, batch_size=4)
    data.setup()
    return task, data


@pytest.mark.slow
def test_default_job_logs_true_values_to_one_offline_wandb_run(tmp_path: Path) -> None:
    train(tmp_path, "trainer.max_steps=12", "trainer.log_every_n_steps=1", "trainer.val_check_interval=6")
    run_dir = tmp_path / "run"
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # one run per job, not one per rank
    records = read_records(next(runs[0].glob("run-*.wandb")))
    cfg, rows = config(records), history(records)
    assert cfg["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
    assert cfg["world_size"] == 2 and cfg["strategy"]["_target_"] == "cuboid.CuboidStrategy"
    losses = {r["trainer/global_step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(losses) == list(range(12))
    # The loss logged at step 0 is the loss of the initial model on the two dp ranks' first batches.
    task, data = debug_task(tmp_path)
    sampler = [torch.utils.data.DistributedSampler(data.train_set, 2, r, shuffle=True, seed=1234) for r in (0, 1)]
    with torch.no_grad():
        per_rank = [task.loss(torch.stack([data.train_set[i] for i in list(s)[:4]])) for s in sampler]
    assert losses[0] == pytest.approx(float(sum(per_rank) / 2), rel=1e-5)
    assert losses[11] < losses[0] - 0.5  # it learns
    perf = [r for r in rows if "perf/tokens_per_s" in r]
    assert perf and all(r["perf/tokens_per_s"] > 0 and r["perf/peak_mem_gb"] > 0.05 for r in perf)
    assert all(0 < r["train/grad_norm"] < 100 for r in rows if "train/grad_norm" in r)
    assert any("lr-AdamW" in r for r in rows)
    val = [r for r in rows if "val/loss" in r]
    assert len(val) == 2 and all(r["val/ppl"] == pytest.approx(math.exp(r["val/loss"]), rel=1e-5) for r in val)
    assert summary(run_dir)["losses"] == pytest.approx([losses[s] for s in range(12)])
    assert (run_dir / "checkpoints" / "last.ckpt" / ".metadata").is_file()


def _single_process_val_ppl(tmp: Path, weights: dict[str, torch.Tensor] | None = None) -> float:
    task, data = debug_task(tmp)
    if weights is not None:
        task.model.load_state_dict(weights)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            total += float(task.loss(batch)) * batch.shape[0]
            count += batch.shape[0]
    return math.exp(total / count)


def _pretrained_debug_llama(out: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The debug Llama with weights of another seed (77), written to ``out`` as a Hugging Face Llama directory (as
    ``export --hf`` writes it): the "pretrained" model the fine-tuning presets start from."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    from cuboid.models.llama import Llama, to_hf_llama

    fields = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "debug.yaml"))
    fields.pop("_target_")
    cfg = LlamaConfig(**fields)
    torch.manual_seed(77)
    weights = Llama(cfg).state_dict()
    state, config = to_hf_llama(weights, cfg)
    out.mkdir()
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config))
    return cfg, weights


@pytest.mark.slow
def test_finetune_preset_starts_from_the_pretrained_weights(tmp_path: Path) -> None:
    """``--config-name finetune`` with ``strategy.pretrained.model=DIR`` (a Hugging Face Llama directory, as
    ``export --hf`` writes) validates exactly like those weights in one process, under dp2 x tp2."""
    weights = _pretrained_debug_llama(tmp_path / "hf")[1]
    train(tmp_path, "--config-name=finetune", "model=debug", "data=stdlib", f"strategy.pretrained.model={tmp_path / 'hf'}",
          "mode=validate", "logger=none", "checkpoint=false", "strategy=fsdp_tp", "trainer.devices=4",
          "trainer.limit_val_batches=1.0")  # fmt: skip
    assert summary(tmp_path / "run")["val_ppl"] == pytest.approx(_single_process_val_ppl(tmp_path, weights), rel=1e-5)
    assert summary(tmp_path / "run")["val_ppl"] != pytest.approx(_single_process_val_ppl(tmp_path), rel=1e-3)


@pytest.mark.slow
def test_finetune_lora_preset_trains_an_adapter_that_peft_loads_on_the_hf_model(tmp_path: Path) -> None:
    """``--config-name finetune_lora``: the reference Llama read from a Hugging Face directory, wrapped with
    ``peft.get_peft_model`` (every projection), trained 6 steps at dp2 x tp2 (sequence parallel, loss parallel)
    with the losses of dp2; its checkpoint holds the adapter only; ``export --peft --hf debug`` writes an adapter
    that ``PeftModel.from_pretrained`` puts on transformers' ``LlamaForCausalLM`` with the trained model's logits."""
    pytest.importorskip("peft")
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from cuboid.checkpoint.export import read_model_weights
    from cuboid.models.llama import Llama

    cfg, weights = _pretrained_debug_llama(tmp_path / "hf")
    job = ["--config-name=finetune_lora", "model=debug", "data=stdlib", f"strategy.pretrained.model={tmp_path / 'hf'}",
           "logger=csv", "trainer.log_every_n_steps=1", "trainer.max_steps=6", "trainer.val_check_interval=6"]  # fmt: skip
    train(tmp_path, *job, "strategy=fsdp_tp", "trainer.devices=4")
    train(tmp_path, *job, "strategy=fsdp", "trainer.devices=2", f"hydra.run.dir={tmp_path / 'dp2'}")
    tp, dp = summary(tmp_path / "run")["losses"], summary(tmp_path / "dp2")["losses"]
    assert len(tp) == 6 and max(abs(a - b) / b for a, b in zip(tp, dp, strict=True)) <= 1e-5, (tp, dp)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    stored = [k for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert stored and all(".lora_" in k for k in stored), [k for k in stored if ".lora_" not in k][:3]
    out = tmp_path / "adapter"
    run_checked([sys.executable, "-m", "cuboid.export", str(ckpt), str(out), "--peft", "--hf", "debug"], timeout=120)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), out).eval()
    # the trained model in one process: the base's weights, get_peft_model as the job did, the adapter read back
    lora = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "finetune_lora.yaml"))["task"]["lora"]
    base = Llama(cfg)
    base.load_state_dict(weights)
    ours = get_peft_model(base, LoraConfig(**lora))
    adapter = {k.removeprefix("model."): v for k, v in read_model_weights(ckpt).items()}
    assert not ours.load_state_dict(adapter, strict=False).unexpected_keys
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = hf(input_ids=tokens).logits, ours(tokens)
        with hf.disable_adapter():
            plain = hf(input_ids=tokens).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert (plain - want).abs().max() > 1e-4  # the adapter changes them: not trivially equal


@pytest.mark.slow
def test_sweep_over_world_size_gives_each_job_its_own_processes(tmp_path: Path) -> None:
    """``-m trainer.devices=1,2``: two jobs, world size 1 then 2; validation perplexity is the same."""
    sweep = tmp_path / "sweep"
    train(
        tmp_path,
        "-m",
        "mode=validate",
        "logger=none",
        "checkpoint=false",
        "trainer.devices=1,2",
        "trainer.limit_val_batches=1.0",
        f"hydra.sweep.dir={sweep}",
    )
    jobs = sweep_jobs(sweep)
    assert [p.name for p in jobs] == ["0", "1"]
    s0, s1 = summary(jobs[0]), summary(jobs[1])
    assert (s0["world_size"], s1["world_size"]) == (1, 2)
    assert len({r["pid"] for r in s1["ranks"]}) == 2
    expected = _single_process_val_ppl(tmp_path)
    assert s0["val_ppl"] == pytest.approx(expected, rel=1e-5)
    assert s1["val_ppl"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_sweep_over_tensor_parallel_runs_each_job_once_with_its_own_wandb_run(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    train(
        tmp_path,
        "-m",
        "strategy.tensor_parallel=1,2",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=2",
        f"hydra.sweep.dir={sweep}",
    )
    jobs = sweep_jobs(sweep)
    assert [p.name for p in jobs] == ["0", "1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "sweep"]  # one sweep directory, nothing else
    for job, tp in zip(jobs, (1, 2), strict=True):
        runs = list((job / "wandb").glob("offline-run-*"))
        assert len(runs) == 1
        cfg = config(read_records(next(runs[0].glob("run-*.wandb"))))
        assert cfg["layout"]["tp"] == tp and cfg["strategy"]["tensor_parallel"] == tp
        assert summary(job)["steps"] == 6 and summary(job)["layout"]["tp"] == tp


@pytest.mark.slow
def test_validation_perplexity_under_tensor_parallel_matches_single_process(tmp_path: Path) -> None:
    train(
        tmp_path,
        "mode=validate",
        "logger=none",
        "checkpoint=false",
        "strategy=fsdp_tp",
        "trainer.limit_val_batches=1.0",
    )
    s = summary(tmp_path / "run")
    assert s["layout"]["tp"] == 2
    assert s["val_ppl"] == pytest.approx(_single_process_val_ppl(tmp_path), rel=1e-5)


@pytest.mark.slow
def test_context_parallel_preset_validates_like_one_process(tmp_path: Path) -> None:
    """``strategy=cp`` (context_parallel=2 on the main job's 2 processes): each 128-token sequence split over both
    ranks, and the validation perplexity is the single-process one."""
    train(tmp_path, "mode=validate", "logger=none", "checkpoint=false", "strategy=cp", "trainer.limit_val_batches=1.0")
    s = summary(tmp_path / "run")
    assert (s["layout"]["cp"], s["layout"]["dp_shard"], s["world_size"]) == (2, 1, 2)
    assert s["val_ppl"] == pytest.approx(_single_process_val_ppl(tmp_path), rel=1e-5)


@pytest.mark.slow
def test_meta_init_job_validates_like_the_eager_one(tmp_path: Path) -> None:
    """The main job's default builds the model on meta: same weights, and the same val/loss from its MeanMetric
    as without (meta init had wiped the metric's state: val/loss 44.9 against 5.56)."""
    got = {}
    for meta in ("true", "false"):
        run_dir = tmp_path / f"meta-{meta}"
        train(tmp_path, "mode=validate", "logger=none", "checkpoint=false", f"task.meta_init={meta}",
              f"hydra.run.dir={run_dir}")  # fmt: skip
        got[meta] = summary(run_dir)["val_loss"]
    assert math.isfinite(got["true"]) and 5.0 < got["true"] < 6.0, got
    assert got["true"] == pytest.approx(got["false"], rel=1e-6)


def slurm_env(rank: int, nodes: int = 2, per_node: int = 2, port: int = 0, ntasks: int | None = None) -> dict:
    return worker_env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="cuboid-test",
        SLURM_NTASKS=str(ntasks if ntasks is not None else nodes * per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_NNODES=str(nodes),
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank % per_node),
        SLURM_NODEID=str(rank // per_node),
        SLURM_NODELIST="localhost",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def test_slurm_task_count_that_does_not_match_nodes_fails_clearly(tmp_path: Path) -> None:
    args = [
        sys.executable,
        TRAIN,
        f"data.cache_dir={tmp_path / 'cache'}",
        *SMALL,
        "trainer.num_nodes=2",
        "trainer.devices=2",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = python(args, timeout=120, env=slurm_env(0, ntasks=3, port=free_port()), cwd=tmp_path)
    assert proc.returncode != 0
    assert "SLURM runs 3 tasks (SLURM_NTASKS) but the Trainer expects num_nodes (2) x devices (2) = 4" in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=fsdp3"], "Could not find 'strategy/fsdp3'"),
        (["data=tokens"], "Missing mandatory value: data.path"),
        (["data=tokens", "data.path=/nonexistent/tokens.bin"], "data.path='/nonexistent/tokens.bin' does not exist"),
        (["data=tokens", "data.path=EMPTY"], "is empty (0 tokens)"),
        (["data.seq_len=512"], "data.seq_len=512 is longer than model.max_seq_len=256"),
    ],
)
def test_bad_input_fails_with_one_clear_line(tmp_path: Path, overrides: list[str], message: str) -> None:
    (tmp_path / "EMPTY").touch()
    overrides = [o.replace("EMPTY", str(tmp_path / "EMPTY")) for o in overrides]
    proc = python(
        [sys.executable, TRAIN, *SMALL[:1], *overrides, f"hydra.run.dir={tmp_path / 'run'}"], 120, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr  # a message, not a stack trace
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_3d_preset_validates_like_one_process_and_trains(tmp_path: Path) -> None:
    """strategy=3d on 8 processes (pp2 x dp2 x tp2), one job: it trains 6 steps with the loss logged from the last
    stage on rank 0, then validates on the whole validation set, and that pipelined validation gives the
    perplexity one process computes with the weights of the job's checkpoint (written after the same step)."""
    from cuboid.checkpoint.export import read_model_weights

    train(
        tmp_path,
        "logger=csv",
        "strategy=3d",
        "trainer.devices=8",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=1.0",
        "trainer.log_every_n_steps=1",
        timeout=600,
    )
    s = summary(tmp_path / "run")
    assert s["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1}
    assert s["steps"] == 6 and len(s["losses"]) == 6 and s["losses"][-1] < s["losses"][0]
    weights = {k.removeprefix("model."): v for k, v in read_model_weights(s["checkpoint"]).items()}
    assert s["val_ppl"] == pytest.approx(_single_process_val_ppl(tmp_path, weights), rel=1e-5)
    assert s["val_ppl"] != pytest.approx(_single_process_val_ppl(tmp_path), rel=1e-3)  # the trained weights'


def test_processes_preparing_the_same_token_file_at_once_all_succeed(tmp_path: Path) -> None:
    """One process per node prepares the data (Lightning's prepare_data_per_node) on a shared filesystem:
    with four at once, each must finish and the file must be whole (each writes its own temporary)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i}.txt").write_text(f"file {i} " * 5000)
    out, go = tmp_path / "tokens.bin", tmp_path / "go"
    code = (
        "import sys, time, pathlib; from cuboid.data import prepare_tokens\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.001)\n"
        f"prepare_tokens([{str(src)!r}], {str(out)!r})"
    )
    ready = [tmp_path / f"ready{i}" for i in range(4)]
    procs = [
        subprocess.Popen([interpreter(), "-c", code, str(r)], env=worker_env(), stderr=subprocess.PIPE, text=True)
        for r in ready
    ]
    deadline = time.time() + 120
    while not all(r.exists() for r in ready) and time.time() < deadline:
        time.sleep(0.01)
    go.touch()  # all four start writing within milliseconds of each other
    errors = [p.communicate(timeout=120)[1] for p in procs]
    for path in [*ready, go]:
        path.unlink()
    assert all(p.returncode == 0 for p in procs), errors
    _, n = prepare_tokens([src], tmp_path / "alone.bin")
    assert out.read_bytes() == (tmp_path / "alone.bin").read_bytes() and n == out.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone.bin", "src", "tokens.bin"]  # no temporaries left


def test_prepare_data_with_a_model_tokenizer_writes_its_token_ids(tmp_path: Path) -> None:
    """``prepare_data.py --tokenizer DIR``: the model's own token ids (uint32, with a sidecar saying so), which
    ``TokenDataModule`` reads back as they were written."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = ["hello", "world", "cuboid", "[UNK]"]
    inner = Tokenizer(models.WordLevel({w: 1000 + i for i, w in enumerate(words)}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "text.txt").write_text("hello world cuboid hello")
    out = tmp_path / "data.tok"
    run_checked([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), str(tmp_path / "text.txt"), "--out",
                 str(out), "--tokenizer", str(tmp_path / "tok")], timeout=120)  # fmt: skip
    expected = AutoTokenizer.from_pretrained(tmp_path / "tok")("hello world cuboid hello\n\n")["input_ids"]
    assert expected[:4] == [1000, 1001, 1002, 1000]
    from cuboid.data import load_tokens

    assert load_tokens(out).tolist() == expected and json.loads(Path(f"{out}.json").read_text())["dtype"] == "uint32"


@pytest.mark.slow
def test_slurm_job_preempted_through_one_task_resumes_when_requeued(tmp_path: Path) -> None:
    """Two tasks with SLURM's variables (one node, job 4242, no launcher of ours): SIGUSR1 to task 1 only, after
    the step-4 checkpoint. Both tasks stop after the same step with one checkpoint and exit 0, rank 0 asking once
    for ``requeue 4242`` from the test's own recorder (``CUBOID_SCONTROL``: a test that simulates SLURM never
    reaches a real controller, which on a login node could requeue a stranger's job 4242). The
    requeued job (same variables, same run directory) resumes there into the same W&B run, and its losses and
    final validation equal an uninterrupted run's under the same variables."""
    import signal

    steps = ["trainer.max_steps=12", "trainer.val_check_interval=4", "trainer.log_every_n_steps=1",
             "trainer.enable_progress_bar=false", "trainer.devices=2"]  # fmt: skip

    calls = tmp_path / "scontrol_calls.txt"
    recorder = tmp_path / "scontrol"
    recorder.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    recorder.chmod(0o755)

    def launch(run: Path) -> list[subprocess.Popen]:
        port = free_port()
        args = [interpreter(), TRAIN, f"data.cache_dir={tmp_path / 'cache'}", *SMALL, *steps, f"hydra.run.dir={run}"]
        env = [{**slurm_env(r, nodes=1, per_node=2, port=port), "CUBOID_SCONTROL": str(recorder)} for r in range(2)]
        return [subprocess.Popen(args, cwd=tmp_path, env=env[r], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for r in range(2)]  # fmt: skip

    def finish(procs: list[subprocess.Popen]) -> list[str]:
        outs = [p.communicate(timeout=300)[0] for p in procs]
        failed = [f"task {r}:\n{o[-3000:]}" for r, (p, o) in enumerate(zip(procs, outs, strict=True)) if p.returncode]
        assert not failed, "\n".join(failed)
        return outs

    finish(launch(tmp_path / "whole"))
    whole = summary(tmp_path / "whole")
    run = tmp_path / "run"
    procs = launch(run)
    deadline = time.time() + 240
    while not list((run / "checkpoints").glob("*step=4.ckpt")) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGUSR1)  # task 1 only: the other learns of it through the per-step agreement
    outs = finish(procs)
    assert calls.read_text() == "requeue 4242\n", calls.read_text()  # once, by rank 0, for this job
    assert f"{recorder} requeue 4242 -> exit code 0" in outs[0], outs[0][-3000:]
    saved = list((run / "checkpoints").glob("preempted-step=*.ckpt"))
    assert len(saved) == 1
    n = int(saved[0].name.split("=")[1].split(".")[0])
    assert 4 <= n < 12 and not (run / "summary.json").exists()
    outs = finish(launch(run))
    assert f"resuming from {saved[0]}" in outs[0]
    second = summary(run)
    assert second["steps"] == 12 and second["cluster_environment"] == "SLURMEnvironment"
    assert second["losses"] == pytest.approx(whole["losses"][n:], rel=1e-5)
    assert second["val_ppl"] == pytest.approx(whole["val_ppl"], rel=1e-5)
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({p.name.rsplit("-", 1)[1] for p in runs}) == 1, runs
