"""Small LightningModules with the shapes that libraries built on Lightning give their models (pytorch-forecasting,
gluonts, darts), written with no thought of Cuboid: what ``fully_shard`` cannot take as a unit of its own.

- ``root_moduledict``: a ``ModuleDict`` of layers as a top-level child (TemporalFusionTransformer's prescalers), and a
  parameter the LightningModule holds itself;
- ``root_modulelist``: a ``ModuleList`` of layers of different classes as a top-level child;
- ``abc_lstm``: an ``nn.LSTM`` subclass with an ``ABC`` base first (pytorch-forecasting's ``LSTM(RNN, nn.LSTM)``,
  ``RNN(ABC, nn.RNNBase)``), whose class ``fully_shard`` cannot swap;
- ``method_step``: a step that calls a method other than ``forward`` of its model (gluonts' ``self.model.loss(...)``);
- ``manual_gan``: manual optimization (``automatic_optimization = False``) with two optimizers, GAN-style:
  ``toggle_optimizer``, ``manual_backward`` twice a step, gradients accumulated by hand over 2 batches and the
  discriminator's clipped by hand (``self.clip_gradients``). Its noise is a function of each sample, so one process
  with the whole batch computes what two data-parallel ranks do.
- ``asks_ddp``: a library's data path chosen by asking ``isinstance(strategy, DDPStrategy)`` (scvi-tools): its own
  ``DistributedSampler`` yielding whole batches, automatic batching off;
- ``own_ema``: an exponential moving average of its own, kept in plain tensors and copied into the parameters
  for validation;
- ``batched_sampler``: the same library's single-process loader (a ``BatchSampler`` passed as ``sampler=``), which
  Lightning makes again around its ``DistributedSamplerWrapper``.

Each regresses 8 features to 1 on the same random data.
"""

from __future__ import annotations

from abc import ABC

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

FEATURES = 8


class _Regression(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.step_losses: list[float] = []

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.step_losses.append(float(loss))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class RootModuleDict(_Regression):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.prescalers = nn.ModuleDict({f"f{i}": nn.Linear(1, 4) for i in range(FEATURES)})
        self.head = nn.Linear(4 * FEATURES, 1)
        self.scale = nn.Parameter(torch.ones(1))  # held by the LightningModule itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = [self.prescalers[f"f{i}"](x[:, i : i + 1]) for i in range(FEATURES)]
        return self.head(torch.relu(torch.cat(scaled, -1))) * self.scale


class RootModuleList(_Regression):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.layers = nn.ModuleList([nn.Linear(FEATURES, 16), nn.LayerNorm(16), nn.Linear(16, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[2](torch.relu(self.layers[1](self.layers[0](x))))


class Recurrent(ABC, nn.LSTM):
    """An LSTM with an ABC base first, as pytorch-forecasting writes its own."""


class AbcLstm(_Regression):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.rnn = Recurrent(input_size=1, hidden_size=8, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x.unsqueeze(-1))
        return self.out(out[:, -1])


class Net(nn.Module):
    """A model whose training goes through ``loss``, not ``forward`` (gluonts' shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.body(x), y)


class MethodStep(_Regression):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.model = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.model.loss(x, y)


class ManualGan(_Regression):
    ACCUMULATE = 2

    def __init__(self, lr: float = 0.02) -> None:
        super().__init__(lr)
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, FEATURES))
        self.disc = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.disc(x)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # the generator's
        x, _ = batch
        return F.softplus(-self.disc(self.gen(self._noise(x)))).mean()

    @staticmethod
    def _noise(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(3 * x[:, :4]) + 0.1 * x[:, 4:]

    def training_step(self, batch, batch_idx):
        x, _ = batch
        g_opt, d_opt = self.optimizers()
        last = (batch_idx + 1) % self.ACCUMULATE == 0
        self.toggle_optimizer(d_opt)
        fake = self.gen(self._noise(x)).detach()
        d_loss = F.softplus(-self.disc(x)).mean() + F.softplus(self.disc(fake)).mean()
        self.manual_backward(d_loss / self.ACCUMULATE)
        if last:
            self.clip_gradients(d_opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            d_opt.step()
            d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.toggle_optimizer(g_opt)
        g_loss = self.loss(batch)
        self.manual_backward(g_loss / self.ACCUMULATE)
        if last:
            g_opt.step()
            g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.step_losses.append(float(d_loss) + float(g_loss))
        self.log("train_loss", d_loss + g_loss, sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return (torch.optim.Adam(self.gen.parameters(), lr=self.hparams.lr),
                torch.optim.Adam(self.disc.parameters(), lr=self.hparams.lr))  # fmt: skip


class BatchDistributedSampler(DistributedSampler):
    """scvi-tools' ``BatchDistributedSampler``: a ``DistributedSampler`` over the world's ranks (read from the
    default process group, as the library builds it for DDP) that yields this rank's indices a batch at a time."""

    def __init__(self, dataset: Dataset, batch_size: int, shuffle: bool) -> None:
        super().__init__(dataset, shuffle=shuffle, seed=0)
        self.batch_size = batch_size

    def __iter__(self):
        indices = list(super().__iter__())
        return iter([indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)])

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)


class LibraryLoader(DataLoader):
    """scvi-tools' ``AnnDataLoader``: one ``__getitem__`` per minibatch, the sampler yielding whole batches and
    automatic batching off (``batch_size=None``); a sampler passed in is used as it is, ``batch_size`` then being
    the library's own argument, not the DataLoader's (so torch's default of 1 applies)."""

    def __init__(self, dataset: Dataset, batch_size: int = 4, shuffle: bool = False, sampler: Sampler | None = None,
                 distributed_sampler: bool = False, **kwargs) -> None:  # fmt: skip
        if sampler is None:
            if distributed_sampler:
                sampler = BatchDistributedSampler(dataset, batch_size, shuffle)
            else:
                order = RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
                sampler = BatchSampler(order, batch_size=batch_size, drop_last=False)
            kwargs.update(batch_size=None, shuffle=False)
        super().__init__(dataset, sampler=sampler, **kwargs)


class AsksDdp(_Regression):
    """A library's model whose data path follows the strategy, as scvi-tools' does: its distributed sampler when
    ``isinstance(strategy, DDPStrategy)``, its single-process loader otherwise; ``sync_dist`` likewise. Records the
    shape of each batch it trains on."""

    ASK = True

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.shapes: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.shapes.append(list(batch[0].shape))
        return super().training_step(batch, batch_idx)

    @classmethod
    def make_loader(cls, strategy: object, dataset: Dataset) -> DataLoader:
        from lightning.pytorch.strategies import DDPStrategy

        ddp = cls.ASK and isinstance(strategy, DDPStrategy)
        return LibraryLoader(dataset, batch_size=4, shuffle=True, distributed_sampler=ddp)


class BatchedSampler(AsksDdp):
    """The same library's single-process loader under any strategy (scvi-tools given ``strategy="cuboid"``, a
    name without "ddp" in it): Lightning wraps its batch sampler and makes the loader again."""

    ASK = False


class OwnEma(_Regression):
    """A module's own exponential moving average, as libraries write one: plain copies of its parameters made in
    ``__init__``, updated after each batch, swapped into the parameters with ``copy_`` for validation and back."""

    DECAY = 0.9

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.ema = [p.detach().clone() for p in self.net.parameters()]
        self.kept: list[torch.Tensor] = []
        self.val_losses: list[float] = []

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)  # on the average
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, sync_dist=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @torch.no_grad()
    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        for average, param in zip(self.ema, self.net.parameters(), strict=True):
            average.mul_(self.DECAY).add_(param.detach(), alpha=1 - self.DECAY)

    @torch.no_grad()
    def on_validation_epoch_start(self) -> None:
        self.kept = [p.detach().clone() for p in self.net.parameters()]
        for average, param in zip(self.ema, self.net.parameters(), strict=True):
            param.copy_(average)

    @torch.no_grad()
    def on_validation_epoch_end(self) -> None:
        for kept, param in zip(self.kept, self.net.parameters(), strict=True):
            param.copy_(kept)
        self.kept = []


PATTERNS = {"root_moduledict": RootModuleDict, "root_modulelist": RootModuleList, "abc_lstm": AbcLstm,
            "method_step": MethodStep, "manual_gan": ManualGan, "asks_ddp": AsksDdp,
            "batched_sampler": BatchedSampler, "own_ema": OwnEma}  # fmt: skip


def data(n: int = 64) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, :3].sum(-1, keepdim=True) * 0.5 + torch.sin(x[:, 3:4])).detach()
    return torch.utils.data.TensorDataset(x, y)
