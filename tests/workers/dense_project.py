"""A common Lightning + Hydra project's model, written with no thought of Cuboid: the network is built by Hydra and
handed to the LightningModule, which saves it among its hyper-parameters, and so is its optimizer (a Hydra partial,
pickled into every checkpoint: a weights-only load refuses it); BatchNorm; ``ReduceLROnPlateau`` on
``val/loss``; ``ModelCheckpoint`` on ``val/acc`` (the shape of the popular project templates)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class SimpleDenseNet(nn.Module):
    def __init__(self, input_size: int = 16, hidden: int = 32, output_size: int = 4) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class ClassifierModule(L.LightningModule):
    def __init__(self, net: nn.Module, lr: float = 0.05, optimizer: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.step_losses: list[float] = []  # this rank's own loss at every training step
        self.epoch_metrics: list[dict[str, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _shared(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), (logits.argmax(-1) == y).float().mean()

    def training_step(self, batch, batch_idx):
        loss, acc = self._shared(batch)
        self.step_losses.append(loss.item())
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train/acc", acc, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, acc = self._shared(batch)
        self.log("val/loss", loss, sync_dist=True, prog_bar=True)
        self.log("val/acc", acc, sync_dist=True)

    def test_step(self, batch, batch_idx):
        loss, acc = self._shared(batch)
        self.log("test/loss", loss, sync_dist=True)
        self.log("test/acc", acc, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            metrics = self.trainer.callback_metrics
            self.epoch_metrics.append({k: float(v) for k, v in metrics.items() if k.startswith(("val/", "train/"))})

    def configure_optimizers(self):
        make = self.hparams.optimizer or partial(torch.optim.SGD, momentum=0.9)  # Hydra's _partial_: a partial
        opt = make(self.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}}
