"""Runs several Cuboid layouts in one torchrun launch and writes what each rank saw.

Usage: torchrun --nproc-per-node N parity_worker.py OUT_DIR RUNS_JSON
RUNS_JSON is a list of {"name", "strategy": {...CuboidStrategy kwargs}, "accumulate", "meta_init"}.
Rank 0 writes OUT_DIR/<name>.pt with losses, final full parameters, and per-rank facts
(batch indices, parameter placements and local shapes, persistent bytes).
"""

from __future__ import annotations

import contextlib
import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import third_party  # noqa: E402
from parity_lib import CLIP, GLOBAL_BATCH, MOE_CFG, SEED, SEQ, LlamaModule, MuonModule, TokenDataset, each_spec  # noqa: E402

from cuboid import CuboidStrategy  # noqa: E402
from cuboid.compat import CudaContracts  # noqa: E402
from cuboid.measure import held_bytes  # noqa: E402
from cuboid.storage import to_path  # noqa: E402


def placements_of(module) -> dict:
    """Each DTensor parameter's mesh dims, placements, local and full shapes."""
    return {
        n: (
            list(p.device_mesh.mesh_dim_names),
            [str(pl) for pl in p.placements],
            list(p.to_local().shape),
            list(p.shape),
        )
        for n, p in module.named_parameters()
        if isinstance(p, DTensor)
    }


class Facts(L.Callback):
    """What each rank saw: samples per step, the dp-mean loss per step, persistent bytes."""

    def __init__(self, watch_link: Path | None = None) -> None:
        self.watch_link = watch_link
        self.link_targets_complete: list[bool] = []  # at each step start: is `last`'s target a whole checkpoint?
        self.bytes: dict[str, int] = {}
        self.estimated_params: int | None = None  # cuboid.measure's estimate of this rank's parameter bytes
        self.losses: list[float] = []
        self.logged: list[float] = []
        self.seen: list[list[int]] = []
        self.ckpt_group_at_start: bool | None = None
        self.placements: dict | None = None  # read at train end: after the run the model is whole again, as DDP's
        self.count_backward = False  # count one backward's ops at train end, on the model as the run built it
        self.backward_ops: dict[str, int] | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.placements = placements_of(pl_module)
        if self.count_backward and trainer.strategy.layout.pp == 1:
            self.backward_ops = backward_ops(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.seen:  # before any save: is the checkpoint process group already there?
            self.ckpt_group_at_start = trainer.strategy.checkpointer._group is not None
        self.seen.append(batch["idx"].tolist())
        if self.watch_link is not None and self.watch_link.is_symlink():
            from cuboid.checkpoint.sharded import is_sharded_checkpoint

            self.link_targets_complete.append(is_sharded_checkpoint(self.watch_link))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # outputs["loss"] is what Lightning backpropagates: the step's loss / accumulate_grad_batches.
        loss = outputs["loss"].detach() * trainer.accumulate_grad_batches
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        # After the first optimizer step: sharded parameters, gradients and AdamW state all exist.
        if not self.bytes and trainer.global_step == 1:
            self.bytes = held_bytes(pl_module, trainer.optimizers[0])
            estimate = trainer.strategy.fit_estimate  # made before sharding, from the unsharded module
            if estimate is not None:
                self.estimated_params = estimate.rank_bytes(trainer.strategy.device_mesh["pp"].get_local_rank())


class InitStats(L.Callback):
    """At the first step's start: each parameter's full mean and standard deviation (the first values), and how
    many elements this rank holds."""

    def __init__(self) -> None:
        self.stats: dict[str, tuple[float, float, int]] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        for name, p in pl_module.named_parameters():
            full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().float()
            local = p.to_local() if isinstance(p, DTensor) else p  # on CPU every shard draws the same numbers
            self.stats[name] = (float(full.mean()), float(full.std()), local.numel())


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(module: LlamaModule) -> dict[str, int]:
    """Count the aten ops run during one backward: activation checkpointing re-runs forward ops there."""
    tokens = TokenDataset()[0]["tokens"].repeat(2, 1)
    loss = module.model(tokens[:, :-1]).float().pow(2).mean()
    counter = _OpCounter()
    with counter:
        loss.backward()
    module.zero_grad()
    collectives = sum(counter.ops.get(k, 0) for k in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"))
    return {"total": sum(counter.ops.values()), "mm": counter.ops.get("mm", 0), "tp_collectives": collectives}


class SignalAt(L.Callback):
    """Send ``signal`` to this process at the end of step ``step`` on rank ``rank``."""

    def __init__(self, rank: int, step: int, signal: str) -> None:
        self.rank, self.step, self.signal = rank, step, signal

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), getattr(signal, self.signal))


class SumOverDpShard(L.Callback):
    """A mutation (``CUBOID_TEST_MUTATION=<spec>:sum_over_dp_shard``): the gradients FSDP reduced over
    ``dp_shard`` are summed instead of averaged (multiplied by its size before clipping and the step), in that spec's
    run only. (FSDP's own ``set_gradient_divide_factor(1.0)`` needs a pre-multiplied sum, which gloo lacks.)"""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        size = trainer.strategy.device_mesh["dp_shard"].size()
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.mul_(size)


class NanLoss(LlamaModule):
    """The loss of step 3 is NaN on rank 1 (its gradients too, so every rank's after the reduce-scatter)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == 3 and self.global_rank == 1 else loss


class NoModelCall(LlamaModule):
    """A step that never calls self.model: it cannot be pipelined, and must say so."""

    def training_step(self, batch, batch_idx):
        return batch["tokens"].float().mean().requires_grad_()


class StrayParameter(LlamaModule):
    """A parameter the LightningModule holds itself, outside every block and submodule (a logit scale)."""

    def __init__(self, meta_init: bool = False) -> None:
        super().__init__(meta_init)
        self.logit_scale = torch.nn.Parameter(torch.tensor(1.0))

    def training_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits = self.model(tokens[:, :-1]) * self.logit_scale
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss


def run_expecting_error(spec: dict, out_dir: Path) -> None:
    """Run a spec that must fail before training; rank 0 records the error message and whether the module's
    parameters were all still on the meta device when it came (nothing materialized)."""
    try:
        run(spec, out_dir)
        message = None
    except Exception as err:  # noqa: BLE001  (the message is what the test checks)
        message = f"{type(err).__name__}: {err}"
    still_meta = all(p.is_meta for p in LAST_MODULE[0].parameters()) if LAST_MODULE else None
    if dist.get_rank() == 0:
        (out_dir / f"{spec['name']}.error.json").write_text(json.dumps({"error": message, "still_meta": still_meta}))
    dist.barrier()


def failing_writer(rank: int, nth: int):
    """DCP writers whose ``nth`` save on ``rank`` fails with ENOSPC ("No space left on device"), injected here: this
    machine gives the test no small filesystem to fill."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    saves = {"n": 0}

    class Full(FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device (injected by the test's storage writer)")

    def make(path):
        saves["n"] += 1
        return Full(path) if saves["n"] == nth and dist.get_rank() == rank else None

    return make


def stalling_writer(victim: int, sentinel: str):
    """A DCP writer whose rank ``victim`` stops for good after writing its first file (a crash mid-save)."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    class Stalling(FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            if dist.get_rank() == victim:
                Path(sentinel).touch()
                time.sleep(600)  # the test kills the job here
            return future

    return lambda path: Stalling(path)


def dying_writer():
    """A DCP writer into object storage whose coordinator (rank 0) dies (``os._exit``) right after DCP's ``finish``
    wrote ``.metadata``: every shard and DCP's own metadata are there, the checksums and the commit marker are not.
    By DCP's and Lightning's rule (``.metadata`` and ``meta.pt``) the checkpoint would look complete."""
    import os

    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # (a test's own writer: DCP's class)

    from cuboid.storage import RemotePath

    class Dying(FsspecWriter):
        def finish(self, metadata, results):
            super().finish(metadata, results)
            os._exit(9)

    return lambda path: Dying(path.url, sync_files=False, **path.options) if isinstance(path, RemotePath) else None


class DeviceOfSize(CuboidStrategy):
    """A CuboidStrategy that checks layouts against a device of ``capacity`` bytes, as it does against a GPU's
    memory; on CPU there is none to check (the test's stand-in for a GPU's size, said as such)."""

    def __init__(self, capacity: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.capacity = capacity

    def _device_capacity(self) -> float | None:
        return self.capacity


LAST_MODULE: list[L.LightningModule] = []


def run(spec: dict, out_dir: Path) -> None:
    L.seed_everything(SEED, verbose=False)
    world = int(dist.get_world_size()) if dist.is_initialized() else int(__import__("os").environ["WORLD_SIZE"])
    if spec.get("device_capacity"):
        strategy = DeviceOfSize(spec["device_capacity"], timeout=timedelta(seconds=90), **spec["strategy"])
    else:
        strategy = CuboidStrategy(timeout=timedelta(seconds=90), **{"data_parallel_shard": "auto", **spec["strategy"]})
    dp = strategy.layout.resolve(world).dp
    if spec.get("stall_on_save"):
        saves = {"n": 0}
        writer = stalling_writer(1, spec["stall_on_save"])

        def second_save_stalls(path):  # the first save completes, the second one stalls
            saves["n"] += 1
            return writer(path) if saves["n"] >= 2 else None

        strategy.checkpointer.storage_writer = second_save_stalls
    if spec.get("die_on_save"):  # the second save: rank 0 dies once DCP's metadata is written
        dying, saves = dying_writer(), {"n": 0}

        def second_save_dies(path):
            saves["n"] += 1
            return dying(path) if saves["n"] >= 2 else None

        strategy.checkpointer.storage_writer = second_save_dies
    if spec.get("fail_save"):  # a full disk on one rank, injected at the storage writer (said as such)
        strategy.checkpointer.storage_writer = failing_writer(**spec["fail_save"])
    family = spec.get("model", "llama")
    if family.startswith("hf_"):  # third_party's families (and their variants, e.g. hf_qwen3_moe_noaux)
        module: L.LightningModule = third_party.HFModule(family, meta_init=spec.get("meta_init", False))
        dataset = third_party.dataset(family, spec.get("samples", 96), spec.get("padded", False), spec.get("seq", SEQ))
        clip = third_party.clip(family, spec.get("padded", False))
    else:
        kinds = {"no_model_call": NoModelCall, "stray_parameter": StrayParameter, "nan_loss": NanLoss}
        module = kinds.get(spec.get("module", ""), LlamaModule)(meta_init=spec.get("meta_init", False))
        if family == "cuboid_moe":  # Cuboid's own MoE (parity_lib.MOE_CFG)
            module = LlamaModule(meta_init=spec.get("meta_init", False), cfg=MOE_CFG)
        if spec.get("optimizer") in ("muon", "muon_everything"):  # cuboid.optim.Muon for the blocks' matrices
            module = MuonModule(meta_init=spec.get("meta_init", False), everything=spec["optimizer"] != "muon")
        dataset = TokenDataset(n=spec.get("samples", 96), seq=spec.get("seq", SEQ))
        clip = CLIP[spec.get("accumulate", 1)]
    clip = spec.get("clip", clip)  # a run's own max norm (e.g. longer sequences, whose gradient norms differ)
    if spec.get("probe_module"):  # a real submodule made in __init__, beside a model built on meta: kept as is
        module.probe = torch.nn.Linear(4, 4)
        torch.nn.init.constant_(module.probe.weight, 0.5)
        torch.nn.init.constant_(module.probe.bias, 0.5)
    LAST_MODULE[:] = [module]
    facts = Facts(Path(spec["save_dir"]) / "last.ckpt" if spec.get("save_last") == "link" else None)
    # (not for compiled blocks: its batch of 2 would make Dynamo compile every block again, for dynamic shapes)
    facts.count_backward = family == "llama" and not spec.get("strategy", {}).get("compile")
    callbacks: list[L.Callback] = [facts]
    if __import__("os").environ.get("CUBOID_TEST_MUTATION") == f"{spec['name']}:sum_over_dp_shard":
        callbacks.append(SumOverDpShard())  # a deliberate bug in one spec, to show its failure stays its own
    if spec.get("save_epoch_end"):  # ModelCheckpoint's default: one checkpoint at the end of every epoch
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=spec["save_epoch_end"], filename="{epoch}-{step}", save_top_k=-1))
    if spec.get("signal_at"):  # a signal to one rank at the end of one step, as SLURM would send it
        callbacks.append(SignalAt(**spec["signal_at"]))
    if spec.get("early_stopping"):
        from lightning.pytorch.callbacks import EarlyStopping

        callbacks.append(EarlyStopping(**spec["early_stopping"]))
    if spec.get("save_every"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(
            ModelCheckpoint(
                dirpath=spec["save_dir"],
                filename="{step}",
                every_n_train_steps=spec["save_every"],
                save_top_k=spec.get("top_k", -1),
                monitor=spec.get("monitor"),
                save_last=spec.get("save_last"),
                save_weights_only=spec.get("save_weights_only", False),
            )
        )
    init_stats = InitStats() if spec.get("init_stats") else None
    if init_stats is not None:
        callbacks.append(init_stats)
    ledger = None
    if spec.get("ledger"):  # the set-up's collectives: who received which weights
        from cuboid.measure import CommLedger

        ledger = CommLedger(log=False, per_step=spec["ledger"] == "per_step")
        callbacks.append(ledger)
    logger: object = False
    if spec.get("log_every"):  # CuboidMonitor's figures, logged every N steps to a CSV file
        from lightning.pytorch.loggers import CSVLogger

        from cuboid import CuboidMonitor

        callbacks.append(CuboidMonitor())
        logger = CSVLogger(out_dir, name=spec["name"], version=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=spec.get("epochs", 1),
        max_steps=spec.get("max_steps", -1),
        gradient_clip_val=clip,
        accumulate_grad_batches=spec.get("accumulate", 1),
        enable_checkpointing=bool(spec.get("save_every") or spec.get("save_epoch_end")),
        logger=logger,
        log_every_n_steps=spec.get("log_every", 50),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        # not the working directory: a stopped run's preemption checkpoint lands here
        default_root_dir=spec.get("default_root_dir") or str(out_dir / f"{spec['name']}.root"),
    )
    # Lightning swaps in a DistributedSampler over the dp ranks, shuffled with the global seed per epoch.
    loader = DataLoader(dataset, batch_size=spec.get("batch_size", GLOBAL_BATCH // dp), shuffle=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    val_loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp) if spec.get("validate") else None
    fit_kwargs = {"weights_only": spec["weights_only"]} if "weights_only" in spec else {}
    import warnings

    # context and expert parallel: every aten op Cuboid calls directly is held to its CUDA kernel's preconditions
    # (not with compiled blocks: Dynamo does not trace under a dispatch mode; their attention runs eagerly anyway)
    layout = spec.get("strategy", {})
    parallel = layout.get("context_parallel", 1) > 1 or layout.get("expert_parallel", 1) > 1
    checked = parallel and not layout.get("compile")
    contracts = CudaContracts() if checked else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, contracts:
        warnings.simplefilter("always")
        resume = spec.get("resume_from")
        if resume and resume.startswith("auto:"):  # as the main job's ckpt_path=auto
            from cuboid import latest_checkpoint

            resume = str(latest_checkpoint(resume[len("auto:") :]))
            strategy.checkpointer.fall_back_when_damaged = True
        try:
            trainer.fit(module, loader, val_loader, ckpt_path=resume, **fit_kwargs)
            stopped_by = None
        except SystemExit as exit_:  # Lightning's SIGTERMException: every rank stopped at the same step
            stopped_by = type(exit_).__name__
    compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    # (read before trainer.predict, which starts its own metrics)
    val_loss = float(trainer.callback_metrics["val_loss"]) if "val_loss" in trainer.callback_metrics else None
    predictions = None
    if spec.get("predict"):  # trainer.predict after fit: this rank's share of the data, in order
        batches = trainer.predict(module, DataLoader(dataset, batch_size=spec.get("batch_size", GLOBAL_BATCH // dp)))
        predictions = torch.cat([p.detach().float().cpu() for p in batches])
    if spec.get("save_after_fit"):
        trainer.save_checkpoint(spec["save_after_fit"])
        strategy.wait_for_checkpoint()
    placements = facts.placements if facts.placements is not None else placements_of(module)
    mine = {
        "seen": facts.seen,
        "losses": facts.losses,
        "logged": facts.logged,
        "placements": placements,
        "bytes": facts.bytes,
        "estimated_params": facts.estimated_params,
        "rank": dist.get_rank(),
        "dp_rank": strategy.dp_mesh.get_local_rank(),
        "dp_sum": int(strategy.reduce(torch.tensor(1.0), reduce_op="sum")),
        "backward_ops": facts.backward_ops,
        "params": sorted(n for n, _ in module.named_parameters()),
        "schedule": type(strategy.pipelining.runner.schedule).__name__ if strategy.pipelining.runner else None,
        # every transformers config's attention implementation, the pipeline stages' own configs too
        "attn_implementations": sorted(
            {
                m.config._attn_implementation
                for root in [module, *(s.submod for s in getattr(strategy.pipelining.runner, "stages", []))]
                for m in root.modules()
                if hasattr(getattr(m, "config", None), "_attn_implementation")
            }
        ),
        "compiled_graphs": compiled_graphs,
        "cuda_contracts": dict(contracts.checked) if checked else None,  # the ops checked, by name
        "stopped_at": trainer.global_step,
        "stopped_by": stopped_by,
        "skipped": list(strategy.nonfinite.skipped),
        "weights_made": dict(strategy.weights_made),
        "loss_parallel": strategy.loss_parallel.enabled,
        "setup_comm": ledger.setup_table if ledger is not None else None,
        "ledger_steps": len(ledger.steps) if ledger is not None else None,  # per_step=False: none
        "ledger_tables": ledger.steps if ledger is not None else None,  # {dim: {kind: [count, bytes]}} per step
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in module.modules()),
        "init_stats": init_stats.stats if init_stats is not None else None,
        "pp_rank": strategy.device_mesh["pp"].get_local_rank(),
        # full bytes of the distinct parameters and buffers this rank holds (what its stage's weights weigh)
        "held_bytes": sum(
            t.numel() * t.element_size() for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
        ),
        "preempted_to": str(strategy.preempted_to) if strategy.preempted_to else None,
        "ckpt_group_at_start": facts.ckpt_group_at_start,
        "stray_warnings": [str(w.message) for w in caught if "outside every FSDP unit" in str(w.message)],
        "damaged_warnings": [str(w.message) for w in caught if "is damaged" in str(w.message)],
        "resumed_from": resume,
        "val_loss": val_loss,
        "predictions": predictions,
        # (rank 0 removes the run lock in its teardown: another rank may list the directory before that)
        "kept": sorted(p.name for p in to_path(spec["save_dir"]).iterdir() if p.name != ".cuboid-run.lock")
        if spec.get("save_dir")
        else None,
        "best": str(Path(trainer.checkpoint_callback.best_model_path).name) if spec.get("monitor") else None,
    }
    if spec.get("validate") and strategy.layout.pp == 1:  # the batch losses the metric saw, recomputed by hand
        with torch.no_grad():
            mine["val_batch_losses"] = [float(third_party.hf_loss(module.model, b)) for b in trainer.val_dataloaders]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if spec.get("async_probe"):
        import time as _time

        blocked: dict = {}
        staged: list = []  # per async save: the host storages its state was copied into
        stager = strategy.checkpointer.stager
        stage = stager.stage

        def spy(state_dict, **kwargs):
            out = stage(state_dict, **kwargs)
            leaves = torch.utils._pytree.tree_leaves(out)
            local = [t.to_local() if isinstance(t, DTensor) else t for t in leaves if isinstance(t, torch.Tensor)]
            staged.append(sorted(t.untyped_storage().data_ptr() for t in local))
            return out

        stager.stage = spy
        for mode in ("sync", "async", "full", "full-async", "async-again"):
            strategy.checkpointer.async_save = "async" in mode
            strategy.checkpointer.format = "full" if mode.startswith("full") else "sharded"
            before = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in module.named_parameters()
            }
            start = _time.perf_counter()
            trainer.save_checkpoint(spec["async_probe"] + f"-{mode}")
            blocked[mode] = _time.perf_counter() - start
            with torch.no_grad():  # change the weights while the background write may still run
                for p in module.parameters():
                    (p.to_local() if isinstance(p, DTensor) else p).add_(1.0)
            strategy.wait_for_checkpoint()
            if dist.get_rank() == 0:
                torch.save(
                    {"before": before, "blocked": blocked, "staged": staged},
                    out_dir / f"{spec['name']}-{mode}-probe.pt",
                )
            dist.barrier()
    own = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in module.named_parameters()}
    # the experts' selection biases (expert_bias_rate; DeepSeek-V3's own buffer), under pp each stage's
    own_biases = {n: b.detach().cpu().clone() for n, b in module.named_buffers()
                  if n.endswith(("expert_bias", "e_score_correction_bias"))}  # fmt: skip
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (own, own_biases))  # pipeline stages hold different parameters
    full = {k: v for share, _ in shares for k, v in share.items()}
    biases = {k: v for _, share in shares for k, v in share.items()}
    kept = None
    if spec.get("whole_after_fit"):  # what a library reads of a model kept sharded (cuboid.dropin.kept), every rank
        from cuboid import whole_state_dict

        try:  # a library method that reads nothing absent from this rank's stage runs as it is
            method: object = type(module.model.get_input_embeddings()).__name__
        except RuntimeError as err:  # else refused by name
            method = str(err)
        everyone_said: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone_said, method)
        kept = {"whole": whole_state_dict(module), "method": everyone_said}
    if dist.get_rank() == 0:
        result = {
            "losses": facts.losses,
            "link_targets_complete": facts.link_targets_complete,
            "params": full,
            "biases": biases,
            "kept": kept,
            "ranks": everyone,
            "mesh": strategy.device_mesh.mesh.tolist(),
            "grad_norm": float(trainer.precision_plugin.last_grad_norm or float("nan")),
            "classes": [type(trainer).__module__, type(strategy).__module__],  # which Lightning package ran it
        }
        if spec.get("log_every"):  # what the logger received: {step: {metric: value}}
            import csv

            rows = csv.DictReader((out_dir / spec["name"] / "version_0" / "metrics.csv").open())
            result["logged"] = [{k: float(v) for k, v in row.items() if v != ""} for row in rows]
        torch.save(result, out_dir / f"{spec['name']}.pt")
    dist.barrier()


def main() -> None:
    out_dir = Path(sys.argv[1])
    for spec in each_spec(sys.argv[2]):
        __import__("os").environ.update(spec.get("env", {}))  # e.g. an object store's endpoint (AWS_ENDPOINT_URL)
        (run_expecting_error if spec.get("expect_error") else run)(spec, out_dir)


if __name__ == "__main__":
    main()
