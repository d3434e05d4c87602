"""A user's own LightningModule in a file outside the Cuboid clone: trains at dp2 with ``strategy="cuboid"`` (a model
this small is replicated, as DDP would), saves checkpoints (one file each, as DDP writes them: ``torch.load`` reads
one), and (``resume``) resumes from one. Prints one JSON line with what it saw."""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cuboid  # registers strategy="cuboid"


class Regressor(L.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: Path, max_steps: int, resume: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    ckpt = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(
        strategy="cuboid",
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    path = str(sorted((out / "ckpts").iterdir())[-1]) if resume else None
    trainer.fit(Regressor(), data, ckpt_path=path)
    if trainer.is_global_zero:
        saved = sorted(p.name for p in (out / "ckpts").iterdir())
        one_file = all((out / "ckpts" / name).is_file() for name in saved)
        readable = "state_dict" in torch.load(out / "ckpts" / saved[-1], weights_only=False)
        print(
            json.dumps(
                {
                    "steps": trainer.global_step,
                    "resumed_from": path,
                    "saved": saved,
                    "one_file": one_file and readable,
                    "strategy": type(trainer.strategy).__module__,
                    "cuboid": cuboid.__file__,
                }
            )
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] == ["resume"])
