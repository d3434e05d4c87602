"""One fault-tolerant replica group (a job of its own): the parity suite's Llama on dp_shard = WORLD_SIZE, trained
with ``CuboidStrategy(fault_tolerance=...)`` against a lighthouse the test runs.

Launched by the test (``replicas_worker.py OUT SPEC_JSON``), one launch per group and per (re)start. Every rank
appends one JSON line per step to ``OUT/<name>.rank<r>.jsonl`` as it goes (a killed group leaves its lines): the
step, the groups in the quorum, the process id, the loss, the sample ids. Rank 0 writes ``OUT/<name>.pt`` at the
end: the full weights, the optimizer's step count, CommLedger's tables and the bytes of its own parameter shards.

Spec keys: ``group``, ``groups``, ``lighthouse``, ``max_steps``; ``die_at`` (every rank of this group kills itself
with SIGKILL when that step starts); ``die_ranks`` (only these ranks of the group kill themselves) and
``die_in: "backward"`` (they kill themselves just before that step's backward, after its quorum: the other groups
are then waiting in the step's average over groups); ``slow_after`` and ``until`` (after that step, each step waits 0.5 s while the
file ``until`` does not exist, at most 120 s in all: the live group steps on, slowly, until the other is back);
``trainer`` (more Trainer arguments, e.g. ``accumulate_grad_batches``); ``ckpt`` (a ModelCheckpoint directory, every 4 steps, in every group); ``rejoined`` (rank 0 writes that file once its quorum holds every group); ``start_with`` (a directory: every
rank waits there for every rank of every group before training, so that the groups start in one quorum).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from cuboid import CommLedger, CuboidStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity_lib import LlamaModule  # noqa: E402
from position_worker import IdTokens  # noqa: E402


class LlamaScheduled(LlamaModule):
    """The parity Llama with a learning rate that changes every step (a scheduler a heal must carry over)."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


class Recorder(L.Callback):
    def __init__(self, spec: dict, out: Path) -> None:
        self.spec, self.out, self.waited = spec, out, 0.0
        self.ids: list[int] = []

    def on_fit_start(self, trainer, module) -> None:
        """Every group's manager is up (made in setup): wait here for the others', so that all start in one
        quorum (a group that comes later heals from the others at its first step)."""
        if self.spec.get("start_with"):
            Path(self.spec["start_with"], f"up{self.spec['group']}.rank{trainer.global_rank}").touch()
            deadline = time.monotonic() + 120
            while len(list(Path(self.spec["start_with"]).glob("up*"))) < 2 * self.spec["groups"]:
                if time.monotonic() > deadline:
                    raise TimeoutError("the other replica group did not start")
                time.sleep(0.05)
            time.sleep(0.5)  # its first heartbeat

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        step, spec = trainer.global_step, self.spec
        if spec.get("die_in", "batch_start") == "batch_start":
            self._die_if_due(trainer)
        while step > spec.get("slow_after", 1 << 30) and not Path(spec["until"]).exists() and self.waited < 120:
            time.sleep(0.5)
            self.waited += 0.5
            break  # one wait per step: the live group keeps stepping
        self.ids = batch["id"].tolist()

    def on_before_backward(self, trainer, module, loss) -> None:
        if self.spec.get("die_in") == "backward":
            self._die_if_due(trainer)

    def _die_if_due(self, trainer) -> None:
        spec = self.spec
        due = spec.get("die_at") is not None and trainer.global_step >= spec["die_at"]
        if due and trainer.global_rank in spec.get("die_ranks", range(trainer.world_size)):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        replicas = trainer.strategy.replicas
        line = {"step": trainer.global_step - 1, "groups": replicas.participants, "pid": os.getpid(),
                "loss": float(outputs["loss"]), "ids": self.ids, "committed": replicas.committed, "batch_idx": batch_idx,
                "logged_step": trainer.fit_loop.epoch_loop._batches_that_stepped}  # fmt: skip
        rank = trainer.global_rank
        with open(self.out / f"{self.spec['name']}.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.spec.get("rejoined") and rank == 0 and replicas.participants == self.spec["groups"]:
            Path(self.spec["rejoined"]).touch()


def main() -> None:
    out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    L.seed_everything(0, verbose=False)
    ft = {"lighthouse": spec["lighthouse"], "replica_group": spec["group"], "groups": spec["groups"],
          "timeout": 20, "quorum_timeout": 60}  # fmt: skip
    callbacks: list = [Recorder(spec, out)]
    ledger = CommLedger(log=False)
    callbacks.append(ledger)
    if spec.get("ckpt"):  # every group has the callback; one group writes
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=spec["ckpt"], every_n_train_steps=4,
                                                             save_top_k=-1, filename="step={step}",
                                                             auto_insert_metric_name=False))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=CuboidStrategy(fault_tolerance=ft, timeout=timedelta(seconds=60), **spec.get("strategy", {})),
        max_steps=spec["max_steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(spec.get("ckpt")),
        callbacks=callbacks,
        **spec.get("trainer", {}),
    )
    module = LlamaScheduled()
    trainer.fit(module, DataLoader(IdTokens(), batch_size=2, shuffle=True))
    mine = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}
    stages: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(stages, mine)  # under pp each rank holds its stage's weights
    full = {k: v for stage in stages for k, v in stage.items()}
    shard_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in module.parameters())
    opt = trainer.optimizers[0]
    steps = {int(s["step"]) for s in opt.state.values() if "step" in s}
    if trainer.global_rank == 0:
        torch.save({"params": full, "optimizer_steps": steps, "global_step": trainer.global_step,
                    "pid": os.getpid(), "comm": ledger.steps, "shard_bytes": shard_bytes},
                   out / f"{spec['name']}.pt")  # fmt: skip


if __name__ == "__main__":
    main()
