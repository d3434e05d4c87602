"""A Fabric training loop written the way litgpt writes one, on Cuboid's Fabric strategy.

Usage: torchrun --nproc-per-node N fabric_worker.py OUT_DIR RUNS_JSON
RUNS_JSON is a list of {"name", "strategy": {...cuboid.fabric.CuboidStrategy kwargs}, "family", "steps", "clip",
"meta_init", "save_at", "save_to", "resume_from", "registered"}. Rank 0 writes OUT_DIR/<name>.pt with the dp-mean
loss per step, the final full parameters (``model.<name>``, as the single-process reference names them) and facts.

The loop (litgpt's pretrain loop, cut down): ``fabric.launch``, ``seed_everything``, ``init_module``,
``setup`` / ``setup_optimizers`` / ``setup_dataloaders``, inputs and targets sliced from one token tensor, the
model's logits, a cross-entropy, ``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step``, a loss
averaged with ``fabric.all_reduce``, and ``fabric.save`` / ``fabric.load`` of ``{"model", "optimizer",
"iter_num"}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import third_party  # noqa: E402
from parity_lib import ADAMW, GLOBAL_BATCH, SEED, each_spec  # noqa: E402

from cuboid.fabric import CuboidStrategy  # noqa: E402


def run(spec: dict, out_dir: Path) -> None:
    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ["WORLD_SIZE"])
    strategy = "cuboid" if spec.get("registered") else CuboidStrategy(**spec.get("strategy", {}))
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(SEED)
    family = spec.get("family", "hf_llama")
    torch.manual_seed(SEED)  # what third_party.initial_model starts from
    with fabric.init_module(empty_init=spec.get("meta_init", False)):
        model = third_party.build_model(family)
    if not spec.get("meta_init"):  # built for real: the same weights as the reference (rank 0's, broadcast)
        model.load_state_dict(third_party.initial_model(family).state_dict())
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), **ADAMW))
    dp = fabric.strategy.dp_mesh.size()
    loader = DataLoader(third_party.dataset(family), batch_size=GLOBAL_BATCH // dp, shuffle=True)
    loader = fabric.setup_dataloaders(loader)

    state = {"model": model, "optimizer": optimizer, "iter_num": 0}
    if spec.get("resume_from"):
        remainder = fabric.load(spec["resume_from"], state, strict=False)
        if "global_step" in remainder:  # a Trainer's checkpoint: its step counter
            state["iter_num"] = remainder["global_step"]
    start = state["iter_num"]
    losses, seen = [], []
    for iter_num, batch in enumerate(loader):
        if iter_num < start:
            continue  # the batches trained before the checkpoint
        if iter_num >= spec.get("steps", 6):
            break
        tokens = batch["tokens"]
        accumulate = spec.get("accumulate", 1)  # the batch in equal microbatches, their mean losses averaged
        loss = torch.zeros(())
        for micro, part in enumerate(tokens.chunk(accumulate)):
            input_ids, targets = part[:, :-1], part[:, 1:]
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                if spec.get("own_loss"):  # the model's own shifted loss, as a transformers user writes it
                    part_loss = model(input_ids=part, labels=part).loss / accumulate
                else:
                    logits = model(input_ids).logits
                    part_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) / accumulate
                fabric.backward(part_loss)
            loss = loss + part_loss.detach()
        fabric.clip_gradients(model, optimizer, max_norm=spec["clip"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        seen.append(batch["idx"].tolist())
        state["iter_num"] = iter_num + 1
        if spec.get("save_at") == state["iter_num"]:
            fabric.save(spec["save_to"], state)

    full = {}
    for name, param in model.module.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        full[f"model.{name}"] = value.detach().cpu().clone()
    optimized = sorted(
        name for name, param in model.module.named_parameters() if optimizer.state.get(param)
    )  # parameters with AdamW state
    placements = {
        n: [str(pl) for pl in p.placements] for n, p in model.module.named_parameters() if isinstance(p, DTensor)
    }
    biases = {f"model.{n}": b.detach().cpu().clone() for n, b in model.module.named_buffers()
              if n.endswith(("expert_bias", "e_score_correction_bias"))}  # expert_bias_rate's  # fmt: skip
    if fabric.global_rank == 0:
        torch.save(
            {"losses": losses, "params": full, "biases": biases, "seen": seen, "optimized": optimized, "placements": placements,
             "layout": fabric.strategy.layout.describe(), "start": start,
             "classes": [type(fabric).__module__, type(fabric.strategy).__module__],
             "trainable": sorted(n for n, p in model.module.named_parameters() if p.requires_grad)},
            out_dir / f"{spec['name']}.pt",
        )  # fmt: skip
    fabric.barrier()


def main() -> None:
    out_dir = Path(sys.argv[1])
    for spec in each_spec(sys.argv[2]):
        if not spec.get("expect_error"):
            run(spec, out_dir)
            continue
        try:  # a spec that must stop: rank 0 records the error message
            run(spec, out_dir)
            message = None
        except Exception as err:  # noqa: BLE001  (the message is what the test checks)
            message = f"{type(err).__name__}: {err}"
        if dist.get_rank() == 0:
            (out_dir / f"{spec['name']}.error.json").write_text(json.dumps({"error": message}))
        dist.barrier()


if __name__ == "__main__":
    main()
