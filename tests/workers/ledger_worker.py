"""The communication ledger on a pipeline whose LightningModule skips the rest of an epoch.

Usage: torchrun --nproc-per-node 2 ledger_worker.py OUT_JSON
pp2 on gloo (the ledger counts send/recv with a dispatch mode entered at each batch start). The module's own
``on_train_batch_start`` returns -1 at the second batch of the first epoch (Lightning then ends the epoch without
``on_train_batch_end``); training goes on into a second epoch. Rank 0 writes the send/recv count of every step and
how many dispatch modes are still entered after ``fit``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import lightning as L
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.data import DataLoader

from cuboid import CuboidStrategy
from cuboid.measure import CommLedger
from cuboid.models import CausalLM, LlamaConfig

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)


class SkipsRestOfFirstEpoch(CausalLM):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.current_epoch == 0 and batch_idx == 1 else None


def main() -> None:
    L.seed_everything(0, verbose=False)
    ledger = CommLedger(log=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=CuboidStrategy(pipeline_parallel=2,
                        timeout=timedelta(seconds=120)), max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[ledger])  # fmt: skip
    tokens = torch.randint(0, CFG.vocab_size, (8 * 3, 33), generator=torch.Generator().manual_seed(0))
    trainer.fit(SkipsRestOfFirstEpoch(model=CFG, warmup_steps=1, max_steps=4), DataLoader(tokens, batch_size=8))
    if trainer.is_global_zero:
        counts = [step.get("pp", {}).get("send_recv", [0, 0])[0] for step in ledger.steps]
        result = {"send_recv_counts": counts, "modes_left": len(_get_current_dispatch_mode_stack())}
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
