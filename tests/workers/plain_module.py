"""A LightningModule written with no thought of Cuboid, trained under ``CuboidStrategy``.

Launched as ``python plain_module.py OUT_DIR``: Lightning's own launcher starts the second
process (it re-runs this script). Rank 0 writes OUT_DIR/result.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from cuboid import CuboidStrategy


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        self.losses: list[float] = []
        self.compute: dict[str, str] = {}
        self.sharded_in_training: bool | None = None  # read in the step: after fit the model is whole again

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.sharded_in_training is None:
            self.sharded_in_training = all(isinstance(p, DTensor) for p in self.parameters())
        out = self.net(x)
        if not self.compute:
            self.compute = {"output": str(out.dtype), "autocast": str(torch.is_autocast_enabled("cpu"))}
        loss = F.mse_loss(out.float(), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x[:, :4].sum(-1, keepdim=True) - x[:, 4:8].prod(-1, keepdim=True)).tanh()
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def _gathered(value: int) -> list[int]:
    values: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0)
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CuboidStrategy(data_parallel_shard="auto"),  # sharded: a model this small is replicated by default
        max_epochs=4,
        default_root_dir=out,
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, data(), data())
    result = {
        "first_losses": model.losses[:5],
        "last_losses": model.losses[-5:],
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "launched_by": type(trainer.strategy.cluster_environment).__name__,
        "world_size": dist.get_world_size(),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "checkpoints": sorted(p.name for p in (out / "checkpoints").iterdir()),
        "checkpoint_files": sorted(p.name for p in next((out / "checkpoints").iterdir()).iterdir()),
        "param_is_dtensor": model.sharded_in_training,
        "threads": _gathered(torch.get_num_threads()),
        "ddp_threads": _suggested_max_num_threads(2),  # what Lightning's DDP gives each of 2 processes on this node
    }
    for precision in ("bf16-mixed", "bf16-true"):
        module = Regressor()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=CuboidStrategy(data_parallel_shard="auto"),
            precision=precision,
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        trainer.fit(module, data())
        result[precision] = {
            **module.compute,
            "plugin": type(trainer.precision_plugin).__name__,
            "sharded_param": str(next(module.parameters()).dtype),
            "finite": all(torch.isfinite(torch.tensor(v)) for v in module.losses),
        }
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
