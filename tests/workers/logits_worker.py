"""Loads Cuboid's Llama through ``pretrained=`` on a layout, and writes the logits it computes.

Usage: torchrun --nproc-per-node N logits_worker.py OUT_DIR RUNS_JSON
Each run: {"name", "cfg": LlamaConfig fields, "tokens": path of a (n, seq) token tensor, "strategy": {... with
"pretrained"}, optional "fit_steps" (train that many steps first, on the tokens as next-token data) and
"save_to" (a checkpoint path written after fitting), "clip"}. Rank 0 writes OUT_DIR/<name>.pt: {"logits": {sample
index: logits}, "grad_norm": the last step's global gradient norm}.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity_lib import each_spec  # noqa: E402

from cuboid import CuboidStrategy  # noqa: E402
from cuboid.models.llama import Llama, LlamaConfig  # noqa: E402


class Tokens(Dataset):
    def __init__(self, path: str) -> None:
        self.tokens = torch.load(path)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "tokens": self.tokens[i]}


class LogitsModule(L.LightningModule):
    """Built on meta, as a user fine-tuning a large model would; records the logits of each validation sample."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model: Llama | None = None
        self.logits: dict[int, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = Llama(self.cfg)

    def training_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def validation_step(self, batch, batch_idx):
        logits = self.model(batch["tokens"])
        if hasattr(logits, "full_tensor"):  # the reference plan's loss parallel: vocabulary-sharded DTensor logits
            logits = logits.full_tensor()
        self.logits.update({int(i): row.detach().cpu().clone() for i, row in zip(batch["idx"], logits, strict=True)})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def run(spec: dict, out_dir: Path) -> None:
    L.seed_everything(0, verbose=False)
    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ["WORLD_SIZE"])
    strategy = CuboidStrategy(timeout=timedelta(seconds=90), **{"data_parallel_shard": "auto", **spec["strategy"]})
    dp = strategy.layout.resolve(world).dp
    module = LogitsModule(LlamaConfig(**spec["cfg"]))
    data = Tokens(spec["tokens"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=spec.get("fit_steps", 0),
        gradient_clip_val=spec.get("clip"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(data, batch_size=len(data) // dp)
    norm = None
    if spec.get("fit_steps"):
        trainer.fit(module, loader)
        norm = float(trainer.precision_plugin.last_grad_norm) if spec.get("clip") else None
        if spec.get("save_to"):
            trainer.save_checkpoint(spec["save_to"])
            strategy.wait_for_checkpoint()
    trainer.validate(module, loader, verbose=False)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, module.logits)
    if dist.get_rank() == 0:
        merged = {i: t for share in everyone for i, t in share.items()}
        torch.save({"logits": merged, "grad_norm": norm}, out_dir / f"{spec['name']}.pt")
    dist.barrier()


def main() -> None:
    out_dir = Path(sys.argv[1])
    for spec in each_spec(sys.argv[2]):
        run(spec, out_dir)


if __name__ == "__main__":
    main()
