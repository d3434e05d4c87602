"""A LoRA fine-tune (``peft.get_peft_model`` on a tiny transformers Llama) in the suite's HFModule, under Cuboid.

Usage: torchrun --nproc-per-node N lora_worker.py OUT_DIR RUNS_JSON
RUNS_JSON is a list of {"name", "strategy": {...CuboidStrategy kwargs}, "steps", "meta_init", "save_dir",
"resume_from"}. Rank 0 writes OUT_DIR/<name>.pt with the dp-mean loss per step, the final full parameters
(``model.<name>``), the trainable names, the names the optimizer holds state for, the placements, and the logits
of the trained model on a fixed batch (``PROBE``).
"""

from __future__ import annotations

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
from parity_lib import GLOBAL_BATCH, SEED, each_spec  # noqa: E402

from cuboid import CuboidStrategy  # noqa: E402
from cuboid.job.launch import close_process_groups  # noqa: E402

FAMILY = "hf_llama_lora"


def probe_batch() -> torch.Tensor:
    """The tokens whose logits the export is checked on: the dataset's first four samples."""
    data = third_party.dataset(FAMILY)
    return torch.stack([data[i]["tokens"] for i in range(4)])


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()
    }


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}
        self.placements: dict[str, list[str]] = {}

    def on_train_start(self, trainer, pl_module) -> None:  # the weights training starts from, as set up
        self.initial = full_params(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def on_train_end(self, trainer, pl_module) -> None:  # after the run the model is plain again, as DDP leaves it
        self.placements = {n: [str(pl) for pl in p.placements] for n, p in pl_module.named_parameters()
                           if isinstance(p, DTensor)}  # fmt: skip


def run(spec: dict, out_dir: Path) -> None:
    L.seed_everything(SEED, verbose=False)
    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ["WORLD_SIZE"])
    strategy = CuboidStrategy(
        timeout=timedelta(seconds=90), **{"data_parallel_shard": "auto", **spec.get("strategy", {})}
    )
    dp = strategy.layout.resolve(world).dp
    module = third_party.HFModule(FAMILY, meta_init=spec.get("meta_init", False))
    losses = Losses()
    callbacks: list[L.Callback] = [losses]
    if spec.get("save_dir"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=spec["save_dir"], filename="{step}", every_n_train_steps=3,
                                         save_top_k=-1))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=spec.get("steps", 6),
        gradient_clip_val=spec.get("clip", third_party.CLIP[FAMILY]),
        enable_checkpointing=bool(spec.get("save_dir")),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(out_dir / f"{spec['name']}.root"),
    )
    loader = DataLoader(third_party.dataset(FAMILY), batch_size=GLOBAL_BATCH // dp, shuffle=True)
    trainer.fit(module, loader, ckpt_path=spec.get("resume_from"))

    names = {id(p): n for n, p in module.named_parameters()}
    optimized = sorted(names[id(p)] for p, s in trainer.optimizers[0].state.items() if s)
    placements = losses.placements
    full = full_params(module)
    module.eval()
    with torch.no_grad():  # the sharded model's own forward: every rank takes part
        logits = module.model(input_ids=probe_batch()).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    if dist.get_rank() == 0:
        torch.save(
            {
                "losses": losses.losses,
                "params": full,
                "initial": losses.initial,
                "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
                "optimized": optimized,
                "placements": placements,
                "logits": logits.detach().clone(),
                "layout": str(strategy.layout.resolve(world)),
            },
            out_dir / f"{spec['name']}.pt",
        )
    dist.barrier()


def main() -> None:
    out_dir = Path(sys.argv[1])
    for spec in each_spec(sys.argv[2]):
        run(spec, out_dir)
    close_process_groups()  # destroyed, and no gloo thread still at work when the interpreter finalizes


if __name__ == "__main__":
    main()
