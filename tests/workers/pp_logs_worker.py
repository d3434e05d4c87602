"""pp2: what the last stage's step logs reaches every rank: names that come and go, Python numbers, a
torchmetrics metric logged as an object, and a CatMetric's list state. Each rank writes OUT/rank<r>.json at the end
of the epoch, with the tensors that crossed a pickled object collective (none may: a pickled tensor unpickles on the
sender's device, another rank's GPU).

    python -m torch.distributed.run --nproc-per-node=2 pp_logs_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchmetrics import CatMetric, MeanMetric

from cuboid import CuboidStrategy
from cuboid.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


class Module(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.model = Llama(CFG)
        self.mean_loss = MeanMetric()
        self.all_losses = CatMetric()  # a list state: one tensor per update
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("train_loss", loss)
        if batch_idx % 3 == 0:  # a name that comes and goes, with a Python number
            self.log("every_third", 0.5 * batch_idx)
        self.mean_loss.update(loss)
        self.all_losses.update(loss.detach())
        self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
        self.losses.append(float(loss))  # on the last stage, once per microbatch
        return loss

    def on_train_epoch_end(self) -> None:
        facts = {
            "metrics": {k: float(v) for k, v in sorted(self.trainer.callback_metrics.items())},
            "update_count": self.mean_loss.update_count,
            "losses": self.losses,
            "cat": [float(t) for t in self.all_losses.value],
            "cat_devices": sorted({t.device.type for t in self.all_losses.value}),
            "pickled_tensors": PICKLED,
        }
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(facts))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


PICKLED: list[str] = []  # what each object collective carried that was a tensor
_broadcast_object_list = dist.broadcast_object_list


def _tensors_in(obj, seen=None):  # noqa: ANN001, ANN202
    """Every tensor inside ``obj`` (lists, tuples, dicts and objects' attributes), read only."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, set)):
        for item in obj:
            yield from _tensors_in(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for item in vars(obj).values():
            yield from _tensors_in(item, seen)


def _recorded(objects, *args, **kwargs):  # noqa: ANN001, ANN202
    PICKLED.extend(f"{tuple(t.shape)} on {t.device}" for t in _tensors_in(objects))
    return _broadcast_object_list(objects, *args, **kwargs)


def main() -> None:
    dist.broadcast_object_list = _recorded
    out = Path(sys.argv[1])
    L.seed_everything(0)
    data = torch.randint(0, CFG.vocab_size, (64, 17), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CuboidStrategy(pipeline_parallel=2, microbatches=2),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(out), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
