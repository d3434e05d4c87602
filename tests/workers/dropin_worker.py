"""Cuboid as a drop-in for Lightning's own strategies: the same modules and checkpoints under DDP,
ModelParallelStrategy and CuboidStrategy, in one torchrun launch.

Usage: torchrun --nproc-per-node N dropin_worker.py OUT_DIR RUNS_JSON
RUNS_JSON is a list of {"name", "strategy": "ddp" | "model_parallel" | "cuboid", "kwargs": {...},
"module": "llama" | "by_hand" | "hf_qwen3", "epochs", "save_after_fit", "resume_from"}.
Rank 0 writes OUT_DIR/<name>.pt with the dp-mean loss per step and the final full parameters.
"""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import third_party  # noqa: E402
from parity_lib import CLIP, GLOBAL_BATCH, SEED, LlamaModule, TokenDataset, each_spec  # noqa: E402

from cuboid import CuboidStrategy  # noqa: E402


class ByHand(LlamaModule):
    """Written for Lightning's ModelParallelStrategy (as in Lightning's own tests of it): configure_model
    parallelizes by hand with self.device_mesh["tensor_parallel"] and self.device_mesh["data_parallel"]."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        dp_mesh = self.device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            plan = {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate()),
            }
            for block in self.model.layers.values():
                parallelize_module(
                    block,
                    tp_mesh,
                    {
                        "attention.wq": ColwiseParallel(),
                        "attention.wk": ColwiseParallel(),
                        "attention.wv": ColwiseParallel(),
                        "attention.wo": RowwiseParallel(),
                        "feed_forward.w1": ColwiseParallel(),
                        "feed_forward.w3": ColwiseParallel(),
                        "feed_forward.w2": RowwiseParallel(),
                    },
                )
            parallelize_module(self.model, tp_mesh, plan)
        for block in self.model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)


class Losses(L.Callback):
    def __init__(self, capture_loaded: bool) -> None:
        self.losses: list[float] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.capture_loaded = capture_loaded

    def on_train_start(self, trainer, pl_module) -> None:
        """The full weights and AdamW state as resumed (before any step), by name: gathered to every rank.

        Only after a resume: on an optimizer without state, get_optimizer_state_dict initializes it with a
        zero-lr step, which advances AdamW's step counter (and so the run)."""
        if not self.capture_loaded:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opt = trainer.optimizers[0]
        osd = get_optimizer_state_dict(pl_module, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()  # noqa: E731
        mine = {n: full(p) for n, p in pl_module.named_parameters()}
        mine.update({k: full(v) for k, v in osd.items() if k.startswith("state.") and torch.is_tensor(v)})
        shares: list = [None] * dist.get_world_size()
        dist.all_gather_object(shares, mine)  # pipeline stages hold different parameters
        self.loaded = {k: v for share in shares for k, v in share.items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


def make_strategy(spec: dict, world: int):
    kwargs = dict(spec.get("kwargs", {}))
    if spec["strategy"] == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(timeout=timedelta(seconds=90)), world
    if spec["strategy"] == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        tp = kwargs.pop("tensor_parallel_size", 1)
        return ModelParallelStrategy(data_parallel_size=world // tp, tensor_parallel_size=tp, **kwargs), world // tp
    strategy = CuboidStrategy(timeout=timedelta(seconds=90), **{"data_parallel_shard": "auto", **kwargs})
    return strategy, strategy.layout.resolve(world).dp


def run(spec: dict, out_dir: Path) -> None:
    L.seed_everything(SEED, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    strategy, dp = make_strategy(spec, world)
    family = spec.get("module", "llama")
    if family in third_party.FAMILIES:
        module: L.LightningModule = third_party.HFModule(family)
        dataset, clip = third_party.dataset(family), third_party.CLIP[family]
    else:
        module = ByHand() if family == "by_hand" else LlamaModule()
        dataset, clip = TokenDataset(), CLIP[1]
    losses = Losses(capture_loaded=bool(spec.get("resume_from")))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=spec.get("epochs", 1),
        gradient_clip_val=clip if spec.get("clip", True) else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp, shuffle=True)
    trainer.fit(module, loader, ckpt_path=spec.get("resume_from"))
    if spec.get("save_after_fit"):
        trainer.save_checkpoint(spec["save_after_fit"])
    pickled: list = [None] * world
    dist.all_gather_object(pickled, _pickles(trainer.strategy))  # each rank's own try
    own = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in module.named_parameters()}
    shares: list = [None] * world
    dist.all_gather_object(shares, own)  # pipeline stages hold different parameters
    if dist.get_rank() == 0:
        params = {k: v for share in shares for k, v in share.items()}
        torch.save(
            {
                "losses": losses.losses,
                "params": params,
                "loaded": losses.loaded if spec.get("resume_from") else None,
                "strategy": type(trainer.strategy).__name__,
                "pickled": pickled,
            },
            out_dir / f"{spec['name']}.pt",
        )
    dist.barrier()


def _pickles(obj: object) -> str:
    """``obj`` through ``pickle`` and back: the class it came back as, or the error."""
    try:
        return type(pickle.loads(pickle.dumps(obj))).__name__
    except Exception as err:  # noqa: BLE001  (what it gave is the result)
        return f"{type(err).__name__}: {err}"


def main() -> None:
    out_dir = Path(sys.argv[1])
    for spec in each_spec(sys.argv[2]):
        run(spec, out_dir)


if __name__ == "__main__":
    main()
