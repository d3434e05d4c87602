"""The modules of ``patterns.py`` under Lightning's DDP and under Cuboid, in one torchrun launch.

Usage: torchrun --nproc-per-node 2 patterns_worker.py OUT_DIR RUNS_JSON
RUNS_JSON: a list of {"name", "strategy": "ddp" | "cuboid" | "cuboid_sharded", "module": a name of
``patterns.PATTERNS``} (``cuboid``: Cuboid's default, which replicates a model this small; ``cuboid_sharded``:
``data_parallel_shard="auto"``, FSDP2). Each spec fits 2 epochs (8 steps each, ``ModelCheckpoint`` on ``val_loss``)
and rank 0 writes OUT_DIR/<name>.pt with each rank's step losses, the final weights (whole), the log lines, and what
the reloads DDP-era code does gave (each the weights, or the error): ``load_from_checkpoint(best)``,
``torch.load(best)["state_dict"]``, ``cuboid.read_model_weights(best)``, and ``load_state_dict`` of whole tensors
into the live model (each weight plus one, read back whole).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity_lib import each_spec  # noqa: E402
from patterns import PATTERNS, data  # noqa: E402

from cuboid import CuboidStrategy, compat, read_model_weights, whole_state_dict  # noqa: E402  (importing cuboid registers "cuboid")


def whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run(spec: dict, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    cls = PATTERNS[spec["module"]]
    module = cls()
    strategy = _strategy(spec)
    before = _pickles(strategy) if not isinstance(strategy, str) else None
    ckpt = ModelCheckpoint(dirpath=out / spec["name"], monitor="val_loss", save_top_k=1)
    averaging = {"ema": lambda: [EMAWeightAveraging(decay=0.9)],  # Lightning's own weight averaging, if asked
                 "swa": lambda: [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)]}  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=2,
        limit_train_batches=8, callbacks=[ckpt, *averaging.get(spec.get("averaging"), list)()], logger=False,
        enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out / spec["name"],
    )  # fmt: skip
    make = getattr(cls, "make_loader", None)  # a library's own loader, built from what the strategy is
    loader = make(trainer.strategy, data()) if make else DataLoader(data(), batch_size=4, shuffle=True)
    log: list[str] = []
    handler = _Lines(log)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader, DataLoader(data(32), batch_size=4))
    logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(handler)
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, module.step_losses)
    pickled = {"strategy_before": before, "strategy": _pickles(trainer.strategy), "trainer": _pickles(trainer)}
    pickles: list = [None] * dist.get_world_size()
    dist.all_gather_object(pickles, pickled)  # each rank's own try: a library may pickle on any of them
    final = whole(module)
    result = {"losses": losses, "params": final, "best": ckpt.best_model_path,
              "warnings": [str(w.message) for w in caught], "log": log, "pickles": pickles}  # fmt: skip
    result["shapes"] = getattr(module, "shapes", None)
    result["own_average"] = [t.detach().clone() for t in getattr(module, "ema", [])]  # whole again after the run
    result["validated"] = module.val_losses if hasattr(module, "val_losses") else None
    copies = compat.averaged_copies(trainer.callbacks)  # Lightning's weight averaging's whole copy, if any
    result["copy_kinds"] = sorted({type(p.data).__name__ for c in copies for p in c.parameters()})
    result["sampler"] = type(trainer.train_dataloader.sampler).__name__
    result["after_fit"] = _after_fit(cls, module, trainer)
    if spec.get("fit_again"):  # the same module, a second fit: sharded anew where the first one sharded it
        again = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=_strategy(spec),
                          max_epochs=1, limit_train_batches=4, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        module.step_losses.clear()
        again.fit(module, DataLoader(data(), batch_size=4, shuffle=True))
        result["again"] = {"losses": list(module.step_losses), "params": whole(module)}
        final = whole(module)
    if spec.get("averaging") == "ema":  # resumed from the best checkpoint for one more epoch, a new module
        L.seed_everything(1, verbose=False)
        resumed = cls()
        more = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=_strategy(spec),
                         max_epochs=3, limit_train_batches=8, callbacks=averaging["ema"](), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)  # fmt: skip
        more.fit(resumed, DataLoader(data(), batch_size=4, shuffle=True), DataLoader(data(32), batch_size=4),
                 ckpt_path=ckpt.best_model_path)  # fmt: skip
        average = compat.averaged_copies(more.callbacks)[0]
        result["resumed"] = {"losses": list(resumed.step_losses), "params": whole(resumed),
                             "average": {k: v.detach().clone() for k, v in average.state_dict().items()}}  # fmt: skip
    module.load_state_dict({k: v + 1 for k, v in final.items()})  # whole tensors into the live model, every rank
    result["live_load"] = {k: v - final[k] for k, v in whole(module).items()}
    if dist.get_rank() == 0:  # as DDP-era code reloads its best weights
        best = ckpt.best_model_path
        result["reloaded"] = _tried(lambda: cls.load_from_checkpoint(best).state_dict())
        result["torch_load"] = _tried(lambda: torch.load(best, weights_only=False)["state_dict"])
        result["current_model_state"] = _tried(lambda: torch.load(best, weights_only=False)["current_model_state"])
        result["read_weights"] = _tried(lambda: read_model_weights(best))
        torch.save(result, out / f"{spec['name']}.pt")
    dist.barrier()


def _strategy(spec: dict) -> CuboidStrategy | str:
    kwargs = {"cuboid": {}, "cuboid_sharded": {"data_parallel_shard": "auto"}}.get(spec["strategy"])
    return CuboidStrategy(**kwargs, **spec.get("kwargs", {})) if kwargs is not None else spec["strategy"]


class LoggedCheckpointIO(TorchCheckpointIO):
    """A library's own CheckpointIO plugin (darts passes one to every Trainer): Lightning's, each call logged."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.calls.append(("save", Path(path).name))
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.calls.append(("load", Path(path).name))
        return super().load_checkpoint(path, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        self.calls.append(("remove", Path(path).name))
        super().remove_checkpoint(path)


def run_with_plugin(spec: dict, out: Path) -> None:
    """Fit 2 epochs with a CheckpointIO plugin and ModelCheckpoint(save_top_k=1) (a save each epoch, the worse one
    removed), then ``validate(ckpt_path="best")``: each rank's plugin calls, the best file's weights, the losses."""
    L.seed_everything(0, verbose=False)
    module = PATTERNS[spec["module"]]()
    plugin = LoggedCheckpointIO()
    ckpt = ModelCheckpoint(dirpath=out / spec["name"], monitor="val_loss", save_top_k=1, filename="{epoch}")
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=_strategy(spec), max_epochs=2,
        limit_train_batches=8, callbacks=[ckpt], logger=False, enable_progress_bar=False, plugins=[plugin],
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out / spec["name"],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data(), batch_size=4, shuffle=True), DataLoader(data(32), batch_size=4))
    validated = trainer.validate(module, DataLoader(data(32), batch_size=4), ckpt_path="best", verbose=False)
    calls: list = [None] * dist.get_world_size()
    dist.all_gather_object(calls, plugin.calls)
    if dist.get_rank() == 0:
        best = torch.load(ckpt.best_model_path, weights_only=False)
        result = {"calls": calls, "best": Path(ckpt.best_model_path).name, "best_state": best["state_dict"],
                  "files": sorted(p.name for p in (out / spec["name"]).glob("*.ckpt")), "validated": validated,
                  "losses": module.step_losses}  # fmt: skip
        torch.save(result, out / f"{spec['name']}.pt")
    dist.barrier()


def _after_fit(cls: type, module: L.LightningModule, trainer: L.Trainer) -> dict:
    """What a library does with the model once ``fit`` returns, on every rank: its class and where its weights
    are, a method other than ``forward`` (``loss``), ``state_dict()`` into a plain module built anew, and the
    module through ``pickle`` (each a loss on the same batch, or the error)."""
    x, y = data(8)[:]
    got: dict = {"class": type(module).__name__, "model_class": type(trainer.model).__name__,
                 "devices": sorted({str(p.device) for p in module.parameters()}),
                 "kinds": sorted({type(p.data).__name__ for p in module.parameters()})}  # fmt: skip
    with torch.no_grad():
        got["method"] = _tried_value(lambda: module.loss((x, y)))
        got["predict_step"] = _tried_value(lambda: module.predict_step((x, y), 0).sum())  # one FSDP registered
        got["plain_load"] = _tried_value(lambda: _loaded(cls, module.state_dict()).loss((x, y)))
        got["whole_load"] = _tried_value(lambda: _loaded(cls, whole_state_dict(module)).loss((x, y)))  # every rank
        got["unpickled"] = _tried_value(lambda: pickle.loads(pickle.dumps(module)).loss((x, y)))
    return got


def _loaded(cls: type, state: dict) -> L.LightningModule:
    fresh = cls()
    fresh.load_state_dict(state)
    return fresh


def _tried_value(call: Callable[[], torch.Tensor]) -> float | str:
    try:
        return float(call())
    except Exception as err:  # noqa: BLE001  (what it gave is the result)
        return f"{type(err).__name__}: {err}"


def _pickles(obj: object) -> str:
    """``obj`` through ``pickle`` and back: the class it came back as, or the error."""
    try:
        return type(pickle.loads(pickle.dumps(obj))).__name__
    except Exception as err:  # noqa: BLE001  (what it gave is the result)
        return f"{type(err).__name__}: {err}"


def _tried(read: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | str:
    try:
        return {k: v.detach() for k, v in read().items()}
    except Exception as err:  # noqa: BLE001  (what it gave is the result)
        return f"{type(err).__name__}: {err}"


def main() -> None:
    out = Path(sys.argv[1])
    for spec in each_spec(sys.argv[2]):
        (run_with_plugin if spec.get("plugin") else run)(spec, out)


if __name__ == "__main__":
    main()
