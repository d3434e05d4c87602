"""Train :mod:`dense_project` the way such a project runs, switched between strategies by one argument.

    python dense_project_worker.py OUT_DIR {ddp|cuboid|single} [sync_batchnorm] [env_load]

``ddp`` and ``cuboid`` run on 2 processes (Lightning's launcher), ``single`` on one with twice the per-rank batch
(the global batch). The network comes from Hydra's ``instantiate``. Fit 3 epochs with ``ModelCheckpoint`` on
``val/acc``, test the best checkpoint, then resume from it for one more epoch. Each rank writes
OUT_DIR/<tag>_rank<r>.pt: its per-step losses, the epoch metrics, the test metrics, the final parameters and buffers
(whole), what was saved, and the warnings it saw. ``env_load``: the checkpoints are loaded with ``weights_only`` left
unset (the caller sets ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, as the template's users do).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from dense_project import ClassifierModule
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import cuboid  # noqa: F401  (registers strategy="cuboid")

SEED = 7
NET = {"_target_": "dense_project.SimpleDenseNet", "input_size": 16, "hidden": 32, "output_size": 4}
OPTIMIZER = {"_target_": "torch.optim.SGD", "_partial_": True, "momentum": 0.9}


def loaders(per_rank_batch: int, single: bool) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 16, generator=g)
    y = (x[:, :4].argmax(-1) + (x[:, 4] > 1).long()) % 4
    data = TensorDataset(x[:128], y[:128])
    # Under 2 processes Lightning shuffles the training data with DistributedSampler (seeded with seed_everything's
    # seed, set_epoch each epoch);
    # one process on the global batch reads the same permutation with the same sampler over one replica.
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED) if single else None
    train = DataLoader(data, batch_size=per_rank_batch, sampler=sampler)
    val = DataLoader(TensorDataset(x[128:], y[128:]), batch_size=per_rank_batch)
    return train, val


def whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in module.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = value.detach().clone()
    return out


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    sync_bn = "sync_batchnorm" in sys.argv[3:]  # for "single": the reference for it (one process, the global batch)
    # as the template's users run its eval and sweep jobs: weights_only left unset, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
    env_load = "env_load" in sys.argv[3:]
    tag = kind + ("_syncbn" if sync_bn else "") + ("_env" if env_load else "")
    devices, batch = (1, 16) if kind == "single" else (2, 8)
    strategy = {"ddp": "ddp", "cuboid": "cuboid", "single": "auto"}[kind]
    seen: list[str] = []
    warnings.showwarning = lambda message, category, *a, **k: seen.append(f"{category.__name__}: {message}")
    L.seed_everything(SEED)
    module = ClassifierModule(instantiate(NET), optimizer=instantiate(OPTIMIZER))
    ckpt = ModelCheckpoint(dirpath=out / tag, monitor="val/acc", mode="max", save_top_k=1, filename="best-{epoch}")

    def trainer(max_epochs: int) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_epochs=max_epochs, sync_batchnorm=sync_bn and kind != "single",
            callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=out / tag, num_sanity_val_steps=0, use_distributed_sampler=kind != "single",
        )  # fmt: skip

    train, val = loaders(batch, kind == "single")
    fit = trainer(3)
    fit.fit(module, train, val)
    # weights_only=False: under DDP the checkpoint pickles the network held in the hyper-parameters, which torch's
    # default (weights_only) refuses to unpickle; such a project passes it, so every strategy here gets it.
    load = {} if env_load else {"weights_only": False}
    tested = fit.test(module, val, ckpt_path="best", verbose=False, **load)[0]
    best = ckpt.best_model_path
    resumed = ClassifierModule(instantiate(NET), optimizer=instantiate(OPTIMIZER))
    again = trainer(4)
    again.fit(resumed, train, val, ckpt_path=best, **load)
    result = {
        "losses": module.step_losses,
        "epochs": module.epoch_metrics,
        "test": tested,
        "best": Path(best).name,
        "resumed_epochs": resumed.epoch_metrics,
        "resumed_steps": again.global_step,
        "params": whole(module),
        "resumed_params": whole(resumed),
        "batchnorm": type(module.net.model[1]).__name__,
        "warnings": seen,
    }
    torch.save(result, out / f"{tag}_rank{fit.global_rank}.pt")


if __name__ == "__main__":
    main()
