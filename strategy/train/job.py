"""Cuboid's main job (Hydra), :mod:`cuboid.train`'s body: train a Llama-style model with CuboidStrategy.

    python -m cuboid.train                                           # debug model, 2 CPU processes
    python -m cuboid.train strategy=fsdp_tp trainer.devices=4 model=debug
    python -m cuboid.train data=tokens data.path=tokens.bin trainer.max_steps=1000
    python -m cuboid.train -m strategy.tensor_parallel=1,2           # sweep: one process group per job
    python -m cuboid.train --help                                    # the config groups and every key

``scripts/train.py`` in a clone runs the same job; its data module is :mod:`cuboid.train.data` (``data=stdlib``,
``data=tokens``; ``cuboid.data`` is the same module under its earlier name). The configs are the installed Hydra tree
``pkg://cuboid.conf``. Rank 0 writes ``summary.json`` in the job's output directory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from cuboid import CuboidStrategy, latest_checkpoint  # importing cuboid registers strategy="cuboid"
from cuboid.callbacks import CommLedger, CuboidMonitor


class LossHistory(L.Callback):
    """Keeps the logged (dp-averaged) training loss of every logged step (``log_every_n_steps``), for summary.json.
    Read only on those steps: reading a device value on the host every step would stall a GPU's launch queue."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self._last = -1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        every, step = trainer.log_every_n_steps, trainer.global_step  # the optimizer has stepped: step = s + 1
        if every and step % every == 0 and step != self._last and "train/loss" in trainer.callback_metrics:
            self._last = step
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


def check_config(cfg: DictConfig) -> None:
    """Fail on settings that cannot work, before any process group starts."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            f"Missing mandatory value: {', '.join(missing)}. Set it on the command line, e.g. {missing[0]}=VALUE."
        )
    if cfg.get("require_pretrained") and not (cfg.strategy.get("pretrained") or {}).get("model"):
        raise ValueError(
            "this preset fine-tunes pretrained weights: set strategy.pretrained.model=PATH (a Hugging Face model "
            "directory, a .safetensors file, or a Cuboid checkpoint)."
        )
    if cfg.mode not in ("fit", "validate"):
        raise ValueError(f"mode={cfg.mode!r}: choose 'fit' (train) or 'validate' (evaluate, e.g. with ckpt_path=DIR).")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} is longer than model.max_seq_len={cfg.model.max_seq_len}. "
            f"Set data.seq_len<={cfg.model.max_seq_len} or raise model.max_seq_len."
        )
    if cfg.data.get("path") is None and cfg.model.vocab_size < 256:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} cannot hold byte tokens (256); set it to >= 256.")


# in the run's directory (not among its checkpoints): a requeued job logs to the same W&B run
WANDB_ID_FILE = "wandb_run_id"


def make_logger(cfg: DictConfig, run_dir: Path, resuming: bool, strategy: Any = None) -> Any:
    """The job's logger. Under fault-tolerant replica groups one W&B run holds the whole training: group 0 logs it
    (a restarted group 0 goes on logging to the run id in its run directory), the other groups log nothing."""
    if not cfg.get("logger"):
        return False
    replicas = getattr(strategy, "replicas", None)
    if replicas is not None and replicas.config.replica_group != 0:
        print(f"cuboid: replica group {replicas.config.replica_group} logs nothing: group 0 keeps the run's one log")
        return False
    logger_cfg = OmegaConf.to_container(cfg.logger, resolve=True)
    if logger_cfg["_target_"].endswith("WandbLogger"):
        if logger_cfg.get("offline") is None:
            has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file()
            logger_cfg["offline"] = not has_key
        id_file = run_dir / WANDB_ID_FILE
        if (resuming or replicas is not None) and id_file.is_file() and not logger_cfg.get("id"):
            logger_cfg.update(id=id_file.read_text().strip(), resume="allow")
    return instantiate(logger_cfg)


def resolve_ckpt_path(ckpt_path: str | None, ckpt_dir: Path) -> str | None:
    """``auto``: the newest complete checkpoint in this run's checkpoint directory (a requeued job's own), or
    None (a fresh start); any other value as given."""
    if ckpt_path != "auto":
        return ckpt_path
    found = latest_checkpoint(ckpt_dir)
    print(f"cuboid: ckpt_path=auto: {'resuming from ' + str(found) if found else 'no checkpoint in ' + str(ckpt_dir)}")
    return str(found) if found else None


def layout_of(strategy: Any, world_size: int) -> dict[str, Any]:
    if isinstance(strategy, CuboidStrategy):
        layout = strategy.layout.resolve(world_size)
        return {
            "pp": layout.pp,
            "dp_replicate": layout.dp_replicate,
            "dp_shard": layout.dp_shard,
            "cp": layout.cp,
            "tp": layout.tp,
            "ep": layout.ep,
        }
    return {"strategy": type(strategy).__name__, "world_size": world_size}


@hydra.main(version_base="1.3", config_path="pkg://cuboid.conf", config_name="train")
def main(cfg: DictConfig) -> None:
    """The Hydra entry point: build the data, the task and the strategy from ``cfg``, then :func:`run`."""
    try:
        check_config(cfg)
        datamodule = instantiate(cfg.data)
        task = instantiate(cfg.task)
        strategy = instantiate(cfg.strategy)
    except (InstantiationException, ValueError, TypeError, NotImplementedError) as err:
        # A configuration mistake: one line naming the key and the fix, no stack trace.
        raise SystemExit(f"cuboid: {err.__cause__ or err}") from None
    run(cfg, datamodule, task, strategy)


def run(cfg: DictConfig, datamodule: L.LightningDataModule, task: L.LightningModule, strategy: Any) -> None:
    """Train (or validate) ``task`` on ``datamodule`` with ``strategy``; rank 0 writes ``summary.json``."""
    L.seed_everything(cfg.seed, workers=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    ckpt_dir = out_dir / "checkpoints"
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, ckpt_dir)
    if cfg.ckpt_path == "auto" and isinstance(strategy, CuboidStrategy):
        # a damaged newest checkpoint (its checksums) makes way for the newest earlier one that verifies
        strategy.checkpointer.fall_back_when_damaged = True
    logger = make_logger(cfg, out_dir, resuming=ckpt_path is not None, strategy=strategy)
    history = LossHistory()
    callbacks: list[L.Callback] = [CuboidMonitor(), history]
    if logger:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if cfg.get("comm_ledger"):  # the debug preset: bytes per collective kind and mesh dimension, per logging step
        callbacks.append(CommLedger())
    if cfg.checkpoint:
        # save_last="link": `last.ckpt` is a link to the newest checkpoint, not a second copy of it
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last="link"))
    trainer: L.Trainer = instantiate(
        cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks, enable_checkpointing=bool(cfg.checkpoint)
    )
    world_size = trainer.num_nodes * trainer.num_devices
    layout = layout_of(strategy, world_size)
    found = getattr(strategy, "cluster_environment", None)  # the strategy this job made: the Trainer gave it one
    environment = type(found).__name__ if found is not None else None
    if logger:
        logger.log_hyperparams(
            {**OmegaConf.to_container(cfg, resolve=True), "layout": layout, "world_size": world_size}
        )
        if trainer.is_global_zero and type(logger).__name__ == "WandbLogger":  # not among the checkpoints, which
            (out_dir / WANDB_ID_FILE).write_text(logger.experiment.id)  # ModelCheckpoint wants empty at its start
    start = time.perf_counter()
    if cfg.mode == "validate":
        trainer.validate(task, datamodule=datamodule, ckpt_path=ckpt_path)
    else:
        trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
    wall = time.perf_counter() - start
    ranks = [None] * dist.get_world_size() if dist.is_initialized() else [None]
    me = {
        "global": trainer.global_rank,
        "local": trainer.local_rank,
        "node": trainer.node_rank,
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
    if dist.is_initialized():
        dist.all_gather_object(ranks, me)
    else:
        ranks = [me]
    if trainer.is_global_zero:
        summary = {
            "first_loss": history.losses[0] if history.losses else None,
            "last_loss": history.losses[-1] if history.losses else None,
            "losses": history.losses,
            "val_loss": float(trainer.callback_metrics.get("val/loss", float("nan"))),
            "val_ppl": float(trainer.callback_metrics.get("val/ppl", float("nan"))),
            "steps": trainer.global_step,
            "wall_s": wall,
            "layout": layout,
            "world_size": world_size,
            "cluster_environment": environment,
            "ranks": ranks,
            "checkpoint": str(out_dir / "checkpoints" / "last.ckpt") if cfg.checkpoint else None,
            "output_dir": str(out_dir),
        }
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        losses = f", loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f}" if history.losses else ""
        print(
            f"Cuboid: {trainer.global_step} steps in {wall:.1f}s{losses}, val ppl {summary['val_ppl']:.2f}; "
            f"output in {out_dir}"
        )
        if logger and type(logger).__name__ == "WandbLogger":
            run_dir = Path(logger.experiment.dir).parent
            offline = logger.experiment.offline
            logger.experiment.finish()
            if offline:
                print(f"W&B offline run saved in {run_dir}; upload it with: wandb sync {run_dir}")


if __name__ == "__main__":
    main()
