"""A project run by Lightning's ``LightningCLI``, as its users write one: ``python cli_project.py fit --config
cli_config.yaml`` (Cuboid chosen by ``class_path`` with ``init_args``) or ``--trainer.strategy=cuboid``. Lightning's
own launcher starts the second process. Rank 0 writes ``result.json`` into the working directory."""

from __future__ import annotations

import json

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import cuboid  # noqa: F401  (registers strategy="cuboid")


class Regressor(L.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.losses: list[float] = []
        self.sharded_in_training: bool | None = None  # read in the step: after fit the model is whole again

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.sharded_in_training is None:
            self.sharded_in_training = all(isinstance(p, DTensor) for p in self.parameters())
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :2].sum(-1, keepdim=True)), batch_size=self.batch_size)


if __name__ == "__main__":
    cli = LightningCLI(Regressor, Data, save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    if cli.trainer.global_rank == 0:
        result = {
            "strategy": f"{type(strategy).__module__}.{type(strategy).__name__}",
            "format": strategy.checkpointer.format,
            "sharded": cli.model.sharded_in_training,
            "whole_after_fit": not any(isinstance(p, DTensor) for p in cli.model.parameters()),
            "hidden": cli.model.hparams.hidden,
            "losses": cli.model.losses,
            "world_size": cli.trainer.world_size,
        }
        with open("result.json", "w") as f:
            json.dump(result, f)
