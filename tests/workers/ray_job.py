"""One training job, launched by Ray Train or by torchrun: the debug Llama, 4 steps an epoch, each rank's step
losses written to OUT/<name>-rank<r>.json at the end of every fit.

Usage:
  python ray_job.py ray OUT JOBS_JSON      a Ray driver (loopback, no dashboard, a small object store) that runs
                                           each job of JOBS_JSON as a TorchTrainer in turn, then shuts Ray down
  torchrun --nproc-per-node N ray_job.py torchrun OUT JOB_JSON   the same job's loop under torchrun

A job: {"name", "workers", "strategy": CuboidStrategy's arguments, "epochs", "run": Ray's run name (the same name
resumes that run's latest checkpoint), "kill_at": a step at which rank 1 kills itself once (SIGKILL),
"flavour": "cuboid" | "plain" (cuboid.CuboidStrategy, not the Ray flavour) | "ray_ddp" | "ray_fsdp" (Ray's own
strategies, for comparison), "max_failures" (1)}. Under Ray each epoch's end reports a
checkpoint (RayTrainReportCallback); a restarted or resumed worker fits from ray.train.get_checkpoint().
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS_PER_EPOCH = 4


def loop(config: dict) -> None:
    """The train loop: the same under Ray and torchrun but for the strategy's flavour and Ray's plugin."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning as L
    import torch.distributed as dist
    from parity_lib import LlamaModule, TokenDataset
    from torch.utils.data import DataLoader

    out, under_ray = Path(config["out"]), config["engine"] == "ray"
    L.seed_everything(0, verbose=False)
    losses: list[list[float]] = []  # [global step, loss] after each step of this fit

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append([trainer.global_step, float(outputs["loss"])])
            kill_at, marker = config.get("kill_at"), out / f"{config['name']}-killed"
            if kill_at == trainer.global_step and trainer.global_rank == 1 and not marker.exists():
                _wait_for_registered_checkpoint(out / "ray_store" / config.get("run", config["name"]))
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks: list = [Record()]
    plugins: list = []
    if under_ray:
        import ray.train
        from ray.train.lightning import RayDDPStrategy, RayFSDPStrategy, RayLightningEnvironment, RayTrainReportCallback

        from cuboid.ray import RayCuboidStrategy

        flavour = config.get("flavour", "cuboid")
        from cuboid import CuboidStrategy

        ray_own = {"ray_fsdp": RayFSDPStrategy, "ray_ddp": RayDDPStrategy}  # Ray's own, for comparison
        cuboid = CuboidStrategy if flavour == "plain" else RayCuboidStrategy  # (plain: refused, naming the flavour)
        strategy = ray_own[flavour]() if flavour in ray_own else cuboid(**config["strategy"])
        callbacks.append(RayTrainReportCallback())
        plugins.append(RayLightningEnvironment())
        devices: int | str = "auto"
    else:
        from cuboid import CuboidStrategy

        strategy = CuboidStrategy(**config["strategy"])
        devices = int(os.environ["WORLD_SIZE"])  # one node
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, plugins=plugins, callbacks=callbacks,
                        max_epochs=config["epochs"], limit_train_batches=STEPS_PER_EPOCH, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    path = None
    if under_ray:
        from ray.train.lightning import prepare_trainer

        trainer = prepare_trainer(trainer)
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            path = str(Path(checkpoint.to_directory()) / RayTrainReportCallback.CHECKPOINT_NAME)
    start = time.perf_counter()
    trainer.fit(LlamaModule(), DataLoader(TokenDataset(64), batch_size=4), ckpt_path=path)
    seconds = time.perf_counter() - start
    rank = dist.get_rank()
    attempt = len(list(out.glob(f"{config['name']}-rank{rank}*.json")))
    record = {"losses": losses, "resumed_from": path is not None, "world": dist.get_world_size(),
              "layout": getattr(trainer.strategy, "layout", None) and trainer.strategy.layout.describe(),
              "seconds": seconds, "steps": trainer.global_step}  # fmt: skip
    (out / f"{config['name']}-rank{rank}-{attempt}.json").write_text(json.dumps(record))


def _wait_for_registered_checkpoint(run: Path, timeout: float = 120.0) -> None:
    """Until Ray's controller has registered a reported checkpoint of this run (its snapshot lists one): a worker
    killed between its report and the controller's next poll of it loses that report, and Ray restarts from the
    one before (seen: the run started over). A real fault comes minutes after a checkpoint, not 0.5 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((run / "checkpoint_manager_snapshot.json").read_text()).get("latest_checkpoint_result"):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"Ray registered no checkpoint of {run} in {timeout:.0f} s")


def drive(out: Path, jobs: list[dict]) -> None:
    """Each job as a TorchTrainer on a Ray started on loopback only, one after another; Ray shut down after."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=max(j["workers"] for j in jobs), include_dashboard=False, object_store_memory=80 * 2**20,
             _node_ip_address="127.0.0.1", log_to_driver=True)  # fmt: skip
    try:
        for job in jobs:
            trainer = TorchTrainer(
                loop,
                train_loop_config={**job, "out": str(out), "engine": "ray"},
                scaling_config=ScalingConfig(num_workers=job["workers"], use_gpu=False),
                run_config=RunConfig(
                    storage_path=str(out / "ray_store"),
                    name=job.get("run", job["name"]),
                    failure_config=FailureConfig(max_failures=job.get("max_failures", 1)),
                ),  # fmt: skip
            )
            start = time.perf_counter()
            try:
                result = trainer.fit()
            except Exception as err:  # noqa: BLE001  (Ray Train 2's fit raises the workers' error: the result)
                summary = {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - start}
            else:
                summary = {"error": repr(result.error) if result.error else None, "metrics": result.metrics,
                           "checkpoint": result.checkpoint.path if result.checkpoint else None,
                           "seconds": time.perf_counter() - start}  # fmt: skip
            (out / f"{job['name']}-driver.json").write_text(json.dumps(summary, default=str))
            print(f"ray_job: {job['name']} done in {summary['seconds']:.1f} s", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("ray", "torchrun"):
        print(__doc__)
        sys.exit(0 if "--help" in sys.argv else 2)
    engine, out = sys.argv[1], Path(sys.argv[2])
    if engine == "ray":
        drive(out, json.loads(sys.argv[3]))
    else:
        loop({**json.loads(sys.argv[3]), "out": str(out), "engine": "torchrun"})
