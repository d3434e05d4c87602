"""A 2-process fit in which one rank is sent a signal mid-epoch (SIGTERM by default).

    python -m torch.distributed.run --nproc-per-node=2 signal_worker.py OUT_DIR SIGNALLED_RANK [SIGNAL]
    python signal_worker.py OUT_DIR SIGNALLED_RANK SIGKILL      # Lightning's own launcher starts rank 1

Each rank that stops writes OUT_DIR/rank<r>.json: the exception it stopped with and the global step. The
signalled rank writes OUT_DIR/signal.json (the wall time) just before the signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cuboid import CuboidStrategy


class Regressor(L.LightningModule):
    def __init__(self, signalled_rank: int, sig: str, out: Path) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        self.signalled_rank, self.sig, self.out = signalled_rank, sig, out

    def training_step(self, batch, batch_idx):
        if batch_idx == 3 and self.global_rank == self.signalled_rank:
            (self.out / "signal.json").write_text(json.dumps({"time": time.time(), "pid": os.getpid()}))
            os.kill(os.getpid(), getattr(signal, self.sig))  # as SLURM, a user or the OOM killer would, mid-step
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class Record(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        facts = {"exception": type(exception).__name__, "global_step": trainer.global_step}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(facts))


def main() -> None:
    out, signalled = Path(sys.argv[1]), int(sys.argv[2])
    sig = sys.argv[3] if len(sys.argv) > 3 else "SIGTERM"
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CuboidStrategy(data_parallel_shard="auto"),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(out)],
        default_root_dir=out,  # the SIGTERM's preemption checkpoint goes here, not into the working directory
    )
    trainer.fit(Regressor(signalled, sig, out), DataLoader(data, batch_size=8))
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps({"exception": None, "global_step": trainer.global_step})
    )


if __name__ == "__main__":
    main()
