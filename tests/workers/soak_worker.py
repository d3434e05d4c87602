"""A soak run: many steps with async checkpoints every N steps, validation and W&B offline, dp2.

    python -m torch.distributed.run --nproc-per-node=2 soak_worker.py OUT_DIR STEPS

Each rank writes OUT_DIR/rank<r>.json: resident memory (MiB) sampled every 25 steps, the threads and child
processes before ``fit`` and after it returned, and the checkpoints kept.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.models import CausalLM, LlamaConfig

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


class Sample(L.Callback):
    def __init__(self) -> None:
        self.rss: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step % 25 == 0:
            self.rss[trainer.global_step] = round(rss_mib(), 1)


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    L.seed_everything(0)
    tokens = torch.randint(0, CFG.vocab_size, (16 * steps, 33), generator=torch.Generator().manual_seed(0))
    sample = Sample()
    os.environ.setdefault("WANDB_MODE", "offline")
    logger = WandbLogger(project="cuboid-soak", save_dir=str(out), offline=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CuboidStrategy(data_parallel_shard="auto", async_checkpoint=True),
        max_steps=steps,
        val_check_interval=100,
        limit_val_batches=4,
        log_every_n_steps=10,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            sample,
            ModelCheckpoint(
                dirpath=out / "ck", every_n_train_steps=50, save_top_k=2, monitor="train/loss", save_last="link"
            ),
        ],  # fmt: skip
    )
    module = CausalLM(model=CFG, warmup_steps=10, max_steps=steps)
    before = {"threads": [t.name for t in threading.enumerate()], "children": psutil.Process().children(recursive=True)}
    before["children"] = [c.name() for c in before["children"]]
    trainer.fit(module, DataLoader(tokens[: 8 * steps], batch_size=4), DataLoader(tokens[8 * steps :], batch_size=4))
    if trainer.is_global_zero:
        logger.experiment.finish()
    after = {"threads": [t.name for t in threading.enumerate()],
             "children": [c.name() for c in psutil.Process().children(recursive=True)]}  # fmt: skip
    facts = {
        "rss": sample.rss,
        "before": before,
        "after": after,
        "kept": sorted(p.name for p in (out / "ck").iterdir()) if (out / "ck").is_dir() else [],
        "steps": trainer.global_step,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
