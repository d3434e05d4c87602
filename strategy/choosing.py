"""``layout="auto"`` in the Trainer's strategy: rank 0 measures and chooses (:func:`cuboid.planning.plan_module`),
every rank takes the choice, and what reads the degrees is made again (:class:`ChoosingLayout`, a part of
:class:`cuboid.CuboidStrategy`)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from cuboid import compat
from cuboid.context import ContextParallel
from cuboid.parallel import FLATTENED, MESH_NAMES, Layout
from cuboid.step import CuboidPrecision


class ChoosingLayout:
    """The strategy's part that applies ``layout="auto"`` at setup, and remakes what reads the mesh."""

    def choose_layout(self, trainer: Any, lm: nn.Module, pipeline_args: tuple) -> None:
        """``layout="auto"``: rank 0 measures ``lm``'s step on the first training batch and chooses (the others
        wait for its answer); the settings and degrees become the choice, and the meshes are built again where the
        degrees changed, and what reads the settings and the mesh is made again. Nothing is sharded or allocated
        yet."""
        from dataclasses import replace

        from cuboid.parallel import LayoutError
        from cuboid.pipeline import Pipelining
        from cuboid.planning import device_of, first_batch, plan_module

        answer: Any = None
        if self.global_rank == 0:
            rng = compat.collect_rng_states()  # a loader's iterator draws its seed: the run must not see that
            try:
                batch = first_batch(compat.train_data(trainer))
                given: dict[str, Any] = {k: getattr(self.layout, k) for k in self.settings.given}
                if self.settings.activation_checkpointing:  # asked for: kept, as the sizes given are
                    given["ac"] = self.settings.activation_checkpointing
                if self.settings.cpu_offload:
                    given["cpu_offload"] = True
                device = device_of(self.root_device, self.num_processes, self.settings.device_memory)
                planned = plan_module(lm, batch, self.world_size, self.num_nodes, device, given,  # type: ignore[attr-defined]
                                      str(trainer.precision), self.settings.block_container)  # fmt: skip
                best = planned.best
                answer = (best.arguments() if best else None, planned.lines, best.prediction() if best else None)
            except LayoutError as err:
                answer = ("error", str(err))
            except Exception as err:  # noqa: BLE001  (the data could not give a batch to measure on)
                answer = (None, [f"Cuboid layout auto: kept the memory-led default: no batch to measure on ({err})."],
                          None)  # fmt: skip
            finally:
                compat.set_rng_states(rng)
        answer = self.broadcast(answer)
        if answer[0] == "error":
            raise LayoutError(answer[1])
        args, lines, self.layout_prediction = answer
        self.layout_choice = args  # the CuboidStrategy arguments that make the layout chosen
        for line in lines:
            rank_zero_info(line)
        if args is None:
            return
        s = self.settings
        replicated = args["data_parallel_shard"] == 1 and args["data_parallel_replicate"] > 1 and args["pipeline_parallel"] == 1 and args["tensor_parallel"] == 1  # fmt: skip
        pp = args["pipeline_parallel"]
        layout = Layout(pp=pp, dp_replicate=1 if replicated else args["data_parallel_replicate"],
                        dp_shard="auto" if replicated else args["data_parallel_shard"],
                        cp=args.get("context_parallel", self.layout.cp), tp=args["tensor_parallel"], ep=self.layout.ep)  # fmt: skip
        settings = replace(s, layout=layout, replicate_if_it_fits=replicated, layout_auto=False,
                           activation_checkpointing=args.get("activation_checkpointing", s.activation_checkpointing),
                           cpu_offload=args.get("cpu_offload", s.cpu_offload), reshard_after_forward=pp == 1)  # fmt: skip
        old = self.dims
        self.init_build(settings)
        self.dims.resolve(self.world_size)
        rebuilt = self.dims.layout != old.layout
        if rebuilt:
            self.dims.build(self.mesh_root_device().type)
        else:
            self.dims = old  # the same degrees: the meshes already built serve
            self.context = ContextParallel(self.dims, settings.compile, settings.activation_checkpointing)
        schedule, micro, virtual, split = pipeline_args
        self.pipelining = Pipelining(self.dims, schedule, args.get("microbatches", micro), virtual, split,
                                     settings.reshard_after_forward)  # fmt: skip
        self._after_mesh()

    def _after_mesh(self) -> None:
        """What reads the mesh once it is built (again, when ``layout="auto"`` chose other degrees)."""
        self.job_guard.after_mesh(self.device_mesh, MESH_NAMES, self.global_rank)
        commit = self.replicas.commit if self.replicas is not None else None  # may a replica group's step commit?
        tied = self.pipelining.tied_elsewhere  # ids known once built (a method, not a lambda: the plugin pickles)
        hooks = {"nonfinite": self.nonfinite, "deferred": self.deferred, "commit": commit, "counted_elsewhere": tied}
        self._precision_plugin = CuboidPrecision(self.precision_plugin.precision, self.device_mesh, FLATTENED, **hooks)
        compat.set_module_device_mesh(self.lightning_module, self.device_mesh)
