"""Fault-tolerant replica groups: each data-parallel replica is its own job, and the jobs keep training when one of
them dies (torchft, PyTorch's fault-tolerance library).

Inside a group everything is as without it: FSDP over ``dp_shard`` (and tp, pp, cp, ep as set) on the group's own
processes and process groups. Across groups, torchft's ``Manager`` does three things each optimizer step:

1. **A quorum** over the lighthouse before the step (torchft's ``start_quorum``): which groups take part. A group
   that is behind (just started or restarted) *heals* here from a live peer: it receives the peer's model shards,
   optimizer state, Lightning loop counters and data position over HTTP, rank for rank (the same layout in every
   group, so rank ``r`` of one group holds what rank ``r`` of another holds), and carries on from the peer's step.
2. **The gradient average** over the groups that take part, after FSDP's reduce-scatter inside the group (FSDP's
   all-reduce hook, through torchft's reconfigurable process group): what HSDP's replicate all-reduce does.
3. **A commit** before the optimizer step (``should_commit``): every group steps, or none does; a step whose
   average failed (a group died inside it) is dropped by all.

The data: Lightning's ``DistributedSampler`` is dealt over ``groups x dp`` slots, group ``g`` taking slots
``g * dp .. g * dp + dp - 1``, so the groups read different samples as HSDP's replicas do. While a group is dead,
its slots' samples of those steps are not trained (they are lost, not handed to the live groups); a group that
heals resumes at the peer's data position, on its own slots.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn


@dataclass(frozen=True)
class FaultTolerance:
    """Where a job's replica group stands among the others.

    Args:
        lighthouse: The torchft lighthouse every group talks to, e.g. ``"http://node0:29510"`` (start it with
            ``torchft_lighthouse --min_replicas 1``; ``docs/fault-tolerance.md``).
        replica_group: This job's group, ``0 .. groups - 1``; a restarted group keeps its number.
        groups: How many groups the data is divided over (the jobs you start).
        min_replicas: The fewest groups a step may commit with.
        timeout: Seconds for an average over groups and for a heal before the step is dropped.
        quorum_timeout: Seconds to wait for a quorum.
    """

    lighthouse: str
    replica_group: int
    groups: int
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 120.0

    @classmethod
    def of(cls, value: FaultTolerance | Mapping[str, Any] | None) -> FaultTolerance | None:
        """``value`` as a :class:`FaultTolerance` (a mapping from a Hydra config, or one already), checked; None
        stays None."""
        if value is None or isinstance(value, FaultTolerance):
            config = value
        else:
            unknown = sorted(set(value) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(
                    f"fault_tolerance has unknown keys {unknown}; it takes lighthouse, replica_group, groups, "
                    "min_replicas, timeout and quorum_timeout."
                )
            config = cls(**dict(value))
        if config is not None:
            config.check()
        return config

    def check(self) -> None:
        if not 0 <= self.replica_group < self.groups:
            raise ValueError(
                f"fault_tolerance: replica_group={self.replica_group} with groups={self.groups}; number the groups "
                f"0 .. {self.groups - 1}, one per job."
            )
        if not 1 <= self.min_replicas <= self.groups:
            raise ValueError(f"fault_tolerance: min_replicas={self.min_replicas} must be 1 .. groups={self.groups}.")
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"fault_tolerance: lighthouse={self.lighthouse!r} is not an address; give it as torchft_lighthouse "
                "prints it, e.g. 'http://node0:29510'."
            )


def _local(value: Any) -> Any:
    """A state with every DTensor replaced by this rank's shard, on the host: what travels to the peer's same rank.

    Through the host, never a second copy on the device: torchft's HTTP transport sends host memory anyway, and a
    device clone of every shard (weights and AdamW's two moments: three times the fp32 shards) would have to fit
    beside the live ones while a peer heals. A host tensor is taken as it is, not copied: torchft serves the state
    under the lock that ``should_commit`` takes before the optimizer step, so nothing changes it while it is sent."""
    if hasattr(value, "to_local"):
        return value.to_local().detach().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(v) for v in value)
    return value


def _like(value: Any, template: Any) -> Any:
    """``value`` (local shards) shaped like ``template``: a DTensor's shard wrapped with the template's placement."""
    if hasattr(template, "to_local"):
        from torch.distributed.tensor import DTensor

        local = value.to(template.to_local().device)
        return DTensor.from_local(
            local, template.device_mesh, template.placements, shape=template.shape, stride=template.stride()
        )
    return value.to(template.device) if isinstance(template, torch.Tensor) else value


def _between_steps(fit_loop: dict[str, Any]) -> dict[str, Any]:
    """The live group's fit-loop state, sent from inside its step (the quorum is taken in ``training_step``: the
    batch is started, not yet processed), as Lightning would have saved it between two steps. Lightning reads a
    state saved mid-batch as a checkpoint written elsewhere in the loop and adds one to the step it gives the
    loggers (measured: the healed group logged every step one ahead of the live group)."""
    progress = fit_loop["epoch_loop.batch_progress"]
    for counts in (progress["total"], progress["current"]):
        counts["ready"] = counts["started"] = counts["processed"]
    return fit_loop


def fsdp_modules(roots: Iterable[nn.Module]) -> list[nn.Module]:
    """Every FSDP module under ``roots``, each once: the LightningModule and, under pp, its pipeline stages' own
    roots (which hold the embeddings, the final norm and the output, and are not among the LightningModule's)."""
    found: dict[int, nn.Module] = {}
    for root in roots:
        for module in root.modules():
            if callable(getattr(module, "set_all_reduce_hook", None)):
                found.setdefault(id(module), module)
    return list(found.values())


class DataPositionKeeper(Protocol):
    """What the replica groups use of the checkpointer's data position (:class:`cuboid.checkpoint.DataPosition`):
    what a live group sends of the data, and taking what a healing group receives."""

    def state(self, trainer: Any, done: int, dp_size: int) -> dict[str, Any]: ...

    def take(self, state: dict[str, Any], dp: tuple[int, int]) -> None: ...


class ReplicaGroups:
    """This job's replica group: torchft's manager, the gradient average over groups, the commit (the precision
    plugin asks :meth:`commit` before each optimizer step), the heal."""

    def __init__(self, config: FaultTolerance, data_parallel_replicate: int = 1) -> None:
        if data_parallel_replicate != 1:
            raise ValueError(
                f"fault_tolerance with data_parallel_replicate={data_parallel_replicate}: the replicas are the "
                f"replica groups (groups={config.groups}, one job each); set data_parallel_replicate=1 in each job."
            )
        self.config = config
        self.manager: Any = None
        self._quorum_open = False
        self._trainer: Any = None
        self._position: DataPositionKeeper | None = None
        self._dp: tuple[int, int] = (0, 1)  # this rank's data-parallel slot and the slots' number, over every group
        self._joined = False
        self.committed: bool | None = None  # whether the last step's optimizer step ran (None before any step)

    # --- the layout and the data ------------------------------------------------------------------------------
    def sampler_kwargs(self, dp_size: int, dp_rank: int) -> dict[str, int]:
        """Lightning's ``DistributedSampler`` over every group's dp slots, this rank on its group's."""
        return {"num_replicas": self.config.groups * dp_size, "rank": self.config.replica_group * dp_size + dp_rank}

    # --- set-up: the manager and the hooks; the first quorum when the train loader is made -------------------
    def probe(self) -> None:
        """Fail now, naming the address, when the lighthouse cannot be reached (its dashboard answers HTTP)."""
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            opener.open(self.config.lighthouse, timeout=min(self.config.timeout, 10.0)).close()
        except OSError as err:
            raise ConnectionError(
                f"fault_tolerance: the lighthouse at {self.config.lighthouse} cannot be reached ({err}). Start it "
                "first (torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000, docs/fault-tolerance.md) and "
                "give the address it prints. Nothing was trained."
            ) from None

    def start(
        self,
        trainer: Any,
        roots: Iterable[nn.Module],
        position: DataPositionKeeper,
        dealt: Mapping[str, int],
        device: torch.device,
    ) -> None:
        """Start torchft's manager for a fit. Handed by the strategy: the trainer (its loop state, module,
        optimizers and schedulers, which the heal sends and takes), ``roots`` (the modules whose FSDP units get
        the average over groups), the checkpointer's data ``position`` and ``dealt``, Lightning's sampler split
        over every group's data-parallel ranks (``rank``, ``num_replicas``), and the ``device`` the model trains
        on (the groups' process group serves it)."""
        # torchft's Rust side logs every quorum and commit at INFO (Cuboid prints the joins and heals); a RUST_LOG
        # of the user's own is kept
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager

        self.probe()
        import logging

        # a line per step otherwise (torchft's own, and its per-quorum and per-commit records); Cuboid says the joins
        # and heals, and torchft's errors ("torchft_errors") stay as they are
        for name in ("torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._trainer, self._position = trainer, position
        self._dp = (int(dealt["rank"]), int(dealt["num_replicas"]))
        modules = fsdp_modules(roots)
        if not modules:
            raise ValueError(
                "fault_tolerance averages gradients over replica groups through FSDP's all-reduce hook, and this "
                "model has no FSDP module: use data_parallel_shard >= 1 with Cuboid's own sharding (no hand-made "
                "configure_model without fully_shard)."
            )
        timeout = timedelta(seconds=self.config.timeout)
        self.manager = Manager(
            pg=self.process_group(timeout, device),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=self.config.min_replicas,
            use_async_quorum=False,  # heal before the step's forward; the quorum is what waits, not the GPU
            replica_id=f"cuboid_{self.config.replica_group}",
            lighthouse_addr=self.config.lighthouse,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ["MASTER_PORT"]),
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.config.quorum_timeout),
            connect_timeout=timeout,
        )
        for module in modules:
            module.set_all_reduce_hook(self._average)
        self._joined = False

    def join(self) -> None:
        """The first step's quorum, when the train loader is about to be made (after ``on_fit_start``): a group
        that starts or restarts behind the others heals here, so its loader starts at the live group's data
        position. Groups whose managers are up by then (every group's is made in ``setup``) start in one quorum."""
        if self.manager is None or self._joined:
            return
        self._joined = True
        self.begin_step()
        rank_zero_info(
            f"Cuboid: replica group {self.config.replica_group} of {self.config.groups} joins at step "
            f"{self._trainer.global_step} with {self.manager.num_participants()} group(s) in the quorum"
        )

    @staticmethod
    def process_group(timeout: timedelta, device: torch.device) -> Any:
        """torchft's process group for the average over groups, by the ``device`` the gradients live on (NCCL for
        CUDA, gloo otherwise: ``accelerator="cpu"`` on a GPU host trains on the host), not by what the host has."""
        if device.type == "cuda":
            from torchft.process_group import ProcessGroupNCCL

            return ProcessGroupNCCL(timeout=timeout)
        from torchft.process_group import ProcessGroupGloo

        return ProcessGroupGloo(timeout=timeout)

    # --- each step ----------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before a step's first forward: the quorum of the groups taking part (once per optimizer step)."""
        if not self._quorum_open:
            self.manager.start_quorum()
            self._quorum_open = True

    def _average(self, grad: torch.Tensor) -> None:
        """FSDP's all-reduce hook: the shard's sum over the groups taking part, divided by their number, waited for
        here, on the stream the hook runs on.

        FSDP2 runs this hook on its own all-reduce stream (``_fsdp_collectives.foreach_reduce``, torch 2.11 and 2.13:
        ``with device_handle.stream(all_reduce_stream): all_reduce_hook(reduce_output)``, then ``post_reduce_stream =
        all_reduce_stream``) and goes on with the gradient on that stream right after it returns: the dtype cast, ``+=`` into an accumulated gradient, the CPU-offload copy, then the
        ``post_reduce_event`` the default stream waits on at the end of backward. torchft's ``Manager.allreduce``
        records the current stream in its ``_ManagedWork``, divides by the number of groups in a callback that runs
        only at ``wait()``, and its ``wait()`` asserts it is called on that same stream (``_assert_same_stream``).
        So the wait belongs here: on CUDA it makes FSDP's stream wait for the average (the host goes on, backward's
        compute still overlaps), and everything FSDP does with the gradient after the hook sees the average; on gloo
        it blocks this thread until the average is in. Waited anywhere later (the default stream after backward),
        CUDA raises, and an accumulated or offloaded gradient would take the sum before the division."""
        self.manager.allreduce(grad).wait()

    def commit(self) -> bool:
        """After backward, before the optimizer step: True when every group of the quorum may step."""
        self._quorum_open = False
        self.committed = bool(self.manager.should_commit())
        if not self.committed:
            rank_zero_info(
                f"Cuboid: replica group {self.config.replica_group}: step {self._trainer.global_step} not committed "
                "(a group of its quorum failed during it); no group stepped, the next step's quorum goes on without it"
            )
        return self.committed

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the checkpoints: the first group of the step's quorum (every group of the
        quorum agrees on it), so one group writes them while it lives and another takes over when it dies."""
        return self.manager is not None and self.manager.participating_rank() == 0

    @property
    def participants(self) -> int:
        return int(self.manager.num_participants()) if self.manager is not None else 0

    # --- the heal: what a peer sends, and taking it ----------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        trainer, position = self._trainer, self._position
        assert position is not None  # set by start
        return {
            "model": _local(nn.Module.state_dict(trainer.lightning_module)),
            "optimizers": [_local(opt.state_dict()) for opt in trainer.optimizers],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "fit_loop": trainer.fit_loop.state_dict(),
            "data": position.state(trainer, trainer.fit_loop.epoch_loop.batch_progress.current.processed, self._dp[1]),
        }

    def _load(self, state: dict[str, Any]) -> None:
        trainer, position = self._trainer, self._position
        assert position is not None  # set by start
        own = nn.Module.state_dict(trainer.lightning_module, keep_vars=True)
        with torch.no_grad():
            for name, value in state["model"].items():
                target = own[name]
                (target.to_local() if hasattr(target, "to_local") else target).copy_(value)
        for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
            params = [p for group in opt.param_groups for p in group["params"]]
            saved["state"] = {i: {k: _like(v, params[i]) if torch.is_tensor(v) and v.dim() else v
                                  for k, v in s.items()} for i, s in saved["state"].items()}  # fmt: skip
            opt.load_state_dict(saved)
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        trainer.fit_loop.load_state_dict(_between_steps(state["fit_loop"]))
        position.take(state["data"], self._dp)
        rank_zero_info(
            f"Cuboid: replica group {self.config.replica_group} healed from a live group at step "
            f"{trainer.global_step}: weights, optimizer and scheduler state, loop counters and data position"
        )

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
