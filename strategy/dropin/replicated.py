"""The Trainer's side of the replicated default (:mod:`cuboid.dropin.replicate`): :class:`Replicating`, mixed into
the Trainer's strategy, wraps the LightningModule in torch's DDP when the default layout chooses it, and drops DDP's
search for unused parameters once the first step has shown there are none."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from cuboid import compat
from cuboid.dropin.after_run import make_plain, refuse_pickling, stays_sharded
from cuboid.dropin.averaging import (
    check_averaging,
    make_whole,
    put_ahead,
    shard_alike,
    shard_own_copies,
    whole_own_copies,
)
from cuboid.dropin.kept import release_calls, serve_calls
from cuboid.dropin.replicate import choose_replication, first_asked, has_unused_parameters, replicate_module
from cuboid.dropin.units import explain_freed_weights

STOPPED = "the run stopped on an error"


class Replicating:
    """What the Trainer's strategy does for a model it replicates (needs the strategy's ``layout``, ``dp_group``,
    ``root_device``, ``num_processes``, ``cpu_offload``, ``pretrained`` and ``precision_plugin``)."""

    _unsharpened_steps: int | None = None  # under DDP: batches seen while it still looks for unused parameters
    _build_hooks: dict[nn.Module, dict[str, set[int]]] | None = None  # the forward hooks Cuboid's own build added
    model: Any
    release_calls = staticmethod(release_calls)  # at setup's start: an earlier run's gathered methods taken away

    @contextmanager
    def noting_build(self, lm: nn.Module) -> Iterator[None]:
        """Around Cuboid's own build of ``lm``: the forward hooks it adds (tensor parallel's keep no handle), so
        that the run's end can take them away with the sharding (:meth:`end_run`)."""
        before = compat.hook_keys(lm)
        self._build_hooks = None
        yield
        empty: dict[str, set[int]] = {}
        self._build_hooks = {module: {table: keys - before.get(module, empty).get(table, set())
                                      for table, keys in tables.items()}
                             for module, tables in compat.hook_keys(lm).items()}  # fmt: skip

    def replicate_if_it_fits(self, lm: nn.Module, **asked: Any) -> bool:
        """The default data-parallel layout: ``lm`` under DDP when it fits each process with room to spare and
        nothing else is asked for (``asked``: settings that ask for sharding, by name); the choice said in one line.
        True when replicated."""
        layout = self.layout  # type: ignore[attr-defined]
        sizes = {"pipeline_parallel": layout.pp, "data_parallel_replicate": layout.dp_replicate,
                 "tensor_parallel": layout.tp, "context_parallel": layout.cp, "expert_parallel": layout.ep}  # fmt: skip
        choice = choose_replication(lm, self.root_device, self.num_processes, sizes,  # type: ignore[attr-defined]
                                    cpu_offload=self.settings.cpu_offload,  # type: ignore[attr-defined]
                                    pretrained=self.settings.pretrained,  # type: ignore[attr-defined]
                                    expert_bias_rate=self.settings.expert_bias_rate,  # type: ignore[attr-defined]
                                    **asked)  # fmt: skip
        rank_zero_info(f"Cuboid: data parallel, {choice.reason}")
        if not choice.replicate:
            return False
        self.model = replicate_module(lm, self.dp_group, self.root_device)  # type: ignore[attr-defined]
        self._unsharpened_steps = 0
        precision = self.precision_plugin  # type: ignore[attr-defined]
        if precision.precision == "bf16-mixed":  # what FSDP2 casts under sharding, autocast does here
            precision.autocast_device = self.root_device.type  # type: ignore[attr-defined]
        return True

    def end_run(self) -> None:
        """At teardown, the model as Lightning's DDP leaves it (:mod:`cuboid.dropin.after_run`): DDP's wrapper
        dropped, or FSDP2's undone when it sharded over the data-parallel ranks only and the run finished; the
        plain module on the CPU, as ``Strategy.teardown`` moves it. A model that stays sharded refuses pickling."""
        lm: Any = self.lightning_module  # type: ignore[attr-defined]
        if lm is None:
            return
        if isinstance(self.model, DistributedDataParallel):
            self.model = lm  # DDPStrategy.teardown
            compat.optimizers_to_device(self.optimizers, torch.device("cpu"))  # type: ignore[attr-defined]
        elif any(True for _ in compat.fsdp_units(lm)) or any(isinstance(p, DTensor) for p in lm.parameters()):
            reason = self._stays_sharded(lm)
            if reason is not None:
                refuse_pickling(lm, reason)
                if reason != STOPPED:  # (a run that stopped on an error is ending: nothing will call the model)
                    self._serve_calls(lm, reason)
                return
            fitted = lm._trainer.state.fn == TrainerFn.FITTING  # the optimizers are this run's
            make_plain(lm, self.optimizers if fitted else ())  # type: ignore[attr-defined]
            compat.drop_hooks(self._build_hooks or {})  # tensor parallel's, and the step's (the next build adds them)
            self._build_hooks = None
            for copy in compat.averaged_copies(lm._trainer.callbacks):  # Lightning's weight averaging's, if sharded
                make_whole(copy)
            whole_own_copies(lm)
            self.model = lm
            rank_zero_info("Cuboid: the model is whole on every rank again after the run, as DDP leaves it (the next "
                           "fit shards it anew)")  # fmt: skip
        if not any(t.is_meta for t in itertools.chain(lm.parameters(), lm.buffers())):  # refused before materializing
            lm.cpu()

    def _serve_calls(self, lm: nn.Module, reason: str) -> None:
        """A model kept sharded answers a library's own methods (:mod:`cuboid.dropin.kept`), said once."""
        split = self.layout.pp > 1  # type: ignore[attr-defined]
        order = self.checkpointer.model_order or []  # type: ignore[attr-defined]
        stages = (self.device_mesh["pp"].get_group(), order) if split else None  # type: ignore[attr-defined]
        served = serve_calls(lm, reason if split else None, stages)
        what = (
            "are refused by name where they fail (each rank holds only its stages)"
            if split
            else "gather what they read when a call meets a sharded weight (every rank makes such a call)"
        )
        calls = f"; its methods {', '.join(served)} {what}" if served else ""
        rank_zero_info(f"Cuboid: the model stays sharded after the run ({reason}){calls}; cuboid.whole_state_dict(model) "
                       "gives its whole weights for a plain module (every rank calls it)")  # fmt: skip

    def _stays_sharded(self, lm: nn.Module) -> str | None:
        trainer = getattr(lm, "_trainer", None)
        if trainer is None or trainer.state.status != TrainerStatus.RUNNING:
            return STOPPED  # a peer may be gone: no collective now
        settings, degrees = self.settings, self._other_degrees()  # type: ignore[attr-defined]
        if self._build_hooks is not None:  # Cuboid's own tensor parallel: its hooks known, undone with the sharding
            degrees.pop("tensor_parallel")
        return stays_sharded(lm, degrees, self.num_processes,  # type: ignore[attr-defined]
                             activation_checkpointing=settings.activation_checkpointing,
                             cpu_offload=settings.cpu_offload,
                             fault_tolerance=getattr(self, "replicas", None) is not None)  # fmt: skip

    def _other_degrees(self) -> dict[str, int]:
        layout = self.layout  # type: ignore[attr-defined]
        return {"pipeline_parallel": layout.pp, "tensor_parallel": layout.tp, "context_parallel": layout.cp,
                "expert_parallel": layout.ep}  # fmt: skip

    def settle_for_libraries(self, trainer: Any) -> None:
        """Once setup has replicated or sharded the model: a library's ``CheckpointIO`` plugin taken or refused
        (:meth:`Checkpointer.use_checkpoint_io`); Lightning's weight-averaging callbacks checked against the layout
        and, for a model sharded over the data-parallel ranks only, their whole copy sharded as the model is
        (:mod:`cuboid.dropin.averaging`)."""
        self.checkpointer.use_checkpoint_io(self.checkpoint_io)  # type: ignore[attr-defined]
        lm: Any = self.lightning_module  # type: ignore[attr-defined]
        others = first_asked(self._other_degrees(), {})  # "tensor_parallel=2, ...", or None: data parallel only
        sharded = any(True for _ in compat.fsdp_units(lm))
        files = sharded and self.checkpointer.format == "sharded" and bool(trainer.checkpoint_callbacks)  # type: ignore[attr-defined]
        check_averaging(trainer.callbacks, f"{others} split it" if others else None, files)
        if not sharded or others is not None:
            return
        averaged = compat.averaged_copies(trainer.callbacks)
        for copy in averaged:
            shard_alike(copy, lm)
        if averaged:
            put_ahead(trainer.callbacks)
        copies = shard_own_copies(lm)
        if copies:
            rank_zero_info(f"Cuboid: the module's own copies of its parameters ({', '.join(copies)}) are sharded as "
                           "the parameters are (cuboid.dropin.averaging)")  # fmt: skip

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward; a forward that differentiates through sharded units itself, said for what it is
        (:func:`cuboid.dropin.units.explain_freed_weights`)."""
        with explain_freed_weights(self.lightning_module):  # type: ignore[attr-defined]
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Lightning's DDP's own (``DDPStrategy.pre_backward``): under manual optimization, a ``manual_backward``
        inside DDP's forward first prepares DDP's reducer for it (else the next forward's bucket rebuild fails)."""
        DDPStrategy.pre_backward(self, closure_loss)  # type: ignore[arg-type]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Under DDP, at the second batch (a backward done): stop looking for unused parameters if there are none
        (not under manual optimization, where each of a step's backward passes may leave others unused)."""
        if self._unsharpened_steps is None:
            return
        if not getattr(self.lightning_module, "automatic_optimization", True):  # type: ignore[attr-defined]
            self._unsharpened_steps = None
            return
        self._unsharpened_steps += 1
        if self._unsharpened_steps == 2:
            self._unsharpened_steps = None
            group, device = self.dp_group, self.root_device  # type: ignore[attr-defined]
            if not has_unused_parameters(self.model, group, device):
                lm = self.model.module
                self.model = lm  # the first DDP goes, and its reducer's hooks with it, before the next one
                gc.collect()
                self.model = replicate_module(lm, group, device, find_unused=False)


# A library asks "is this DDP?" (scvi-tools: ``isinstance(trainer.strategy, DDPStrategy)``) to choose its data path
# and its ``sync_dist``: Cuboid's strategy is DDP's drop-in, so it answers yes (an ABC's virtual subclass; Lightning's
# own checks, ``is_distributed`` and compile support, answer as for DDP). What the library's loader does then is
# checked against the layout in ``process_dataloader`` (cuboid.dropin.loaders).
DDPStrategy.register(Replicating)
