"""Pins of the internals Cuboid uses through cuboid.compat, one process each, no launcher.

Each test states the behaviour Cuboid relies on. When a Lightning, torch, torchmetrics or transformers
upgrade changes one, the failure is here, with its name, instead of in users' runs. CI runs this file
at the floor versions too.
"""

from __future__ import annotations

import random
import sys
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from harness import python
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cuboid import compat
from cuboid.compat import attention as compat_attention


class _Recorder(L.LightningModule):
    """Records the order of Lightning's hooks around one optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.calls: list[str] = []

    def training_step(self, batch, batch_idx):
        self.calls.append("training_step")
        return self.layer(batch[0]).sum()

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.calls.append("optimizer_zero_grad")
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def backward(self, loss, *args, **kwargs):
        self.calls.append("backward")
        super().backward(loss, *args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    defaults = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False}
    return L.Trainer(default_root_dir=tmp_path, enable_model_summary=False, **{**defaults, **kwargs})


def _data(n: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2)), batch_size=1)


def test_selective_checkpointing_keeps_every_fused_attention_kernel() -> None:
    """Each fused kernel torch may pick for scaled_dot_product_attention (its forward aten op) is in
    ``compat.SDPA_OPS``, so selective AC saves attention whichever kernel runs (cuDNN's was missing: on Hopper,
    attention would have been recomputed in backward). A kernel a new torch adds fails here until it is listed."""
    fused = {
        name
        for name in dir(torch.ops.aten)
        if name.startswith("_scaled_dot_product_") and not name.endswith("_backward") and "_math" not in name
    }
    kept = {op.name().split("::")[1].split(".")[0] for op in compat.SDPA_OPS}
    assert fused == kept, f"not kept: {sorted(fused - kept)}; no longer in torch: {sorted(kept - fused)}"


def test_selective_checkpointing_recomputes_twice_with_repeatable_recompute() -> None:
    """A zero-bubble schedule's split backward (input gradients, then weights', as two autograd calls) recomputes a
    selectively checkpointed block twice. torch's recompute mode refuses the second ("backward an extra time");
    ``compat.RepeatableRecompute`` (which reads the mode's private ``storage``) gives both the outputs it saved, and
    the two calls' gradients equal one backward's."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def block(x, w):
        return torch.sin(x @ w).sum()

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    want = torch.autograd.grad(block(x, w), (x, w))

    def split_backward(context_fn):
        out = checkpoint(block, x, w, use_reentrant=False, context_fn=context_fn)
        (dx,) = torch.autograd.grad(out, x, retain_graph=True)  # the input pass
        (dw,) = torch.autograd.grad(out, w)  # the weight pass
        return dx, dw

    def torch_own():
        return create_selective_checkpoint_contexts(policy)

    with pytest.raises(RuntimeError, match="backward an extra time"):
        split_backward(torch_own)

    def repeatable():
        forward, recompute = create_selective_checkpoint_contexts(policy)
        assert isinstance(recompute.storage, dict)  # the private attribute RepeatableRecompute reads
        return forward, compat.RepeatableRecompute(recompute)

    got = split_backward(repeatable)
    assert all(torch.allclose(g, e) for g, e in zip(got, want, strict=True))


def test_automatic_optimization_runs_step_then_zero_grad_then_backward(tmp_path) -> None:
    """Pipelining runs forward and backward inside training_step, so Cuboid zeroes gradients before the schedule
    and keeps them across Lightning's zero_grad: that relies on exactly this order."""
    module = _Recorder()
    _trainer(tmp_path, max_steps=1, enable_checkpointing=False).fit(module, _data())
    assert module.calls == ["training_step", "optimizer_zero_grad", "backward"]


def test_model_checkpoint_links_last_through_the_routed_function(tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    links: list[tuple[str, str]] = []
    callback = ModelCheckpoint(dirpath=tmp_path / "ck", save_last="link")
    compat.route_link_checkpoint(callback, lambda trainer, filepath, linkpath: links.append((filepath, linkpath)))
    _trainer(tmp_path, max_steps=2, callbacks=[callback]).fit(_Recorder(), _data(2))
    assert links and links[-1][1].endswith("last.ckpt") and links[-1][0].endswith("step=2.ckpt"), links


def test_should_accumulate_is_true_exactly_on_batches_without_a_step(tmp_path) -> None:
    seen: list[bool] = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            seen.append(compat.should_accumulate(trainer))

    trainer = _trainer(
        tmp_path, max_epochs=1, accumulate_grad_batches=2, callbacks=[Watch()], enable_checkpointing=False
    )
    trainer.fit(_Recorder(), _data(5))
    assert seen == [True, False, True, False, False]  # the epoch's last batch steps too
    assert trainer.global_step == 3


def test_lightning_module_device_mesh_reads_what_the_strategy_sets() -> None:
    module, mesh = _Recorder(), object()
    compat.set_module_device_mesh(module, mesh)
    assert module.device_mesh is mesh


def test_rng_states_round_trip_with_the_keys_checkpoints_store() -> None:
    np = pytest.importorskip("numpy")
    states = compat.collect_rng_states(include_cuda=False)
    assert {"torch", "numpy", "python"} <= set(states)
    first = (torch.rand(3), np.random.rand(), random.random())
    compat.set_rng_states(states)
    again = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_meta_module_parallelized_by_hand_materializes_with_its_own_init() -> None:
    with torch.device("meta"):
        layer = nn.Linear(4, 4)
    compat.materialize_distributed_module(layer, torch.device("cpu"))
    assert not layer.weight.is_meta and torch.isfinite(layer.weight).all() and layer.weight.abs().sum() > 0


def test_module_apply_reaches_metric_states_and_fsdp_style_overrides() -> None:
    """materialize_meta goes through _apply: a torchmetrics metric beside a meta layer keeps its state."""
    from torchmetrics import MeanMetric

    from cuboid.parallel.materialize import materialize_meta

    holder = nn.Module()
    holder.metric = MeanMetric()
    holder.metric.update(torch.tensor(4.0))
    with torch.device("meta"):
        holder.layer = nn.Linear(2, 2)
    materialize_meta(holder, torch.device("cpu"))
    assert not holder.layer.weight.is_meta
    assert holder.metric.compute() == 4.0


def test_a_metric_given_copied_states_computes_them() -> None:
    """Under pipeline parallelism the last stage's metric states are copied to the other pp ranks."""
    from torchmetrics import MeanMetric

    source, target = MeanMetric(), MeanMetric()
    source.update(torch.tensor([2.0, 4.0]))
    for name, value in source.metric_state.items():
        setattr(target, name, value.clone())
    compat.set_metric_update_count(target, source.update_count)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compute() before update() would warn
        assert target.compute() == 3.0
    assert target.update_count == 1


def test_shallow_module_copy_changes_its_own_children_only() -> None:
    original = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    view = compat.shallow_module_copy(original)
    setattr(view, "1", None)
    assert original[1] is not None and view[0] is original[0]
    assert view[0].weight is original[0].weight


def test_swap_parameter_installs_a_plain_tensor_for_a_forward() -> None:
    layer = nn.Linear(2, 1, bias=False)
    weight = layer.weight
    compat.swap_parameter(layer, "weight", torch.ones(1, 2))
    assert layer(torch.ones(1, 2)).item() == 2.0
    compat.swap_parameter(layer, "weight", weight)
    assert layer.weight is weight


def test_transformers_layers_say_whether_they_only_read_their_cache() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    layer = transformers.LlamaForCausalLM(config).model.layers[0]
    assert hasattr(type(layer), "_can_checkpoint_with_cache")
    assert compat.reads_kv_cache_only(layer) is False  # it writes the cache: Cuboid drops it under checkpointing


def test_launcher_parts_and_process_group_helpers(tmp_path, monkeypatch) -> None:
    """The launcher Cuboid extends and the child command it builds; the default group, the all-reduce behind
    Strategy.reduce, and mesh flattening, in a one-process gloo group."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    cmd = compat.basic_subprocess_cmd()
    assert isinstance(cmd, list) and cmd[0] == sys.executable
    launcher = compat.SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    assert launcher.is_interactive_compatible is False
    fabric_launcher = compat.FabricSubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    assert fabric_launcher.is_interactive_compatible is False and callable(fabric_launcher.launch)
    assert compat.default_process_group_backend(torch.device("cpu")) == "gloo"
    assert compat.default_process_group_backend(torch.device("cuda", 0)) == "nccl"

    monkeypatch.setenv("MASTER_PORT", str(__import__("harness").free_port()))
    env = LightningEnvironment()
    env.set_world_size(1)
    env.set_global_rank(0)
    assert not compat.distributed_is_initialized()
    compat.init_dist_connection(env, "gloo")
    try:
        assert compat.distributed_is_initialized() and dist.get_world_size() == 1
        value = torch.tensor([3.0])
        assert compat.sync_ddp_if_available(value, None, reduce_op="mean").item() == 3.0
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
        flat = compat.flatten_mesh(mesh["a", "b"], "ab")
        assert flat.size() == 1 and flat.mesh_dim_names == ("ab",)
        with pytest.warns(UserWarning, match="Slicing a flattened dim"):  # why Cuboid keeps its views itself
            assert mesh["ab"].mesh_dim_names == ("ab",)
        two = compat.unflatten_mesh(flat, (1, 1), ("x", "y"))
        assert two.mesh_dim_names == ("x", "y") and two["y"].size() == 1
        from cuboid.parallel.mesh import Layout, build_device_mesh, fsdp_mesh, submesh

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Cuboid's own lookups never take torch's deprecated path
            root, dp = build_device_mesh(Layout(dp_shard=1), "cpu")
            assert submesh(root, "dp") is dp and fsdp_mesh(root).mesh_dim_names == ("dp_shard",)
            assert submesh(root, "dp_shard_cp").mesh_dim_names == ("dp_shard_cp",)
        store = compat.default_store()  # the peer watchdog's heartbeats: set, check, get on the rendezvous store
        store.set("cuboid/heartbeat/0", "1")
        assert store.check(["cuboid/heartbeat/0"]) and store.get("cuboid/heartbeat/0") == b"1"
    finally:
        dist.destroy_process_group()


def test_optimizer_state_moves_but_step_stays() -> None:
    layer = nn.Linear(2, 2)
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    opt.step()
    step = opt.state[layer.weight]["step"]
    compat.optimizers_to_device([opt], torch.device("meta"))
    assert opt.state[layer.weight]["exp_avg"].is_meta
    assert opt.state[layer.weight]["step"] is step


def test_set_sampler_epoch_reaches_a_distributed_sampler() -> None:
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(torch.arange(8))
    loader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=True))
    compat.set_sampler_epoch(loader, 3)
    assert loader.sampler.epoch == 3


def test_update_dataloader_remakes_a_loader_with_its_own_batch_sampler_class_around_a_new_sampler() -> None:
    """Lightning's ``_update_dataloader`` (what injects its DistributedSampler): a loader subclass made again with
    its own arguments, a custom batch sampler's class kept around the new sampler (torchdata's loader has both)."""
    from torch.utils.data import BatchSampler, SequentialSampler
    from torch.utils.data.distributed import DistributedSampler

    class Batches(BatchSampler):
        pass

    class Loader(DataLoader):
        pass

    data = TensorDataset(torch.arange(8))
    loader = Loader(data, batch_sampler=Batches(SequentialSampler(data), batch_size=2, drop_last=False))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    remade = compat.update_dataloader(loader, sampler)
    assert type(remade) is Loader and type(remade.batch_sampler) is Batches
    assert remade.batch_sampler.sampler is sampler and remade.batch_sampler.batch_size == 2
    assert [b[0].tolist() for b in remade] == [[1, 3], [5, 7]]


def test_foreach_mul_scales_tensors_of_one_dtype_by_a_tensor_in_place() -> None:
    tensors = [torch.ones(3), torch.full((2, 2), 2.0)]
    compat.foreach_mul_(tensors, torch.tensor(0.5))
    assert torch.equal(tensors[0], torch.full((3,), 0.5)) and torch.equal(tensors[1], torch.ones(2, 2))


def test_fake_process_group_builds_meshes_in_one_process() -> None:
    import sys

    code = (
        "from cuboid import compat; import torch.distributed as dist; compat.init_fake_process_group(16);"
        "from torch.distributed.device_mesh import init_device_mesh;"
        "m = init_device_mesh('cpu', (4, 4), mesh_dim_names=('dp', 'tp')); print(dist.get_world_size(), m['tp'].size())"
    )
    out = python([sys.executable, "-c", code], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["16", "4"]


def test_the_weights_only_a_user_passed_is_read_where_lightning_drops_it() -> None:
    """Lightning's ``Trainer._run`` restores a strategy that restores after setup without passing ``weights_only``
    on (``_restore_modules_and_callbacks(ckpt_path)``); ``compat.requested_weights_only`` reads it from ``_run``'s
    frame. Pinned both ways: Lightning still drops it there (when it stops, Cuboid can take what it is given), and the
    frame's local is found from below it."""
    import inspect

    from lightning.pytorch.trainer import trainer as trainer_module

    source = inspect.getsource(trainer_module.Trainer._run)
    if "weights_only" in inspect.signature(trainer_module.Trainer._run).parameters:  # Lightning 2.6: it drops it
        assert "self._checkpoint_connector._restore_modules_and_callbacks(ckpt_path)\n" in source
    # (Lightning 2.5, the floor, takes no weights_only in its Trainer: there is nothing to read)

    namespace = {"__name__": "lightning.pytorch.trainer.trainer", "compat": compat}
    exec("def _run(weights_only):\n    return (lambda: compat.requested_weights_only())()", namespace)
    assert namespace["_run"](False) is False and namespace["_run"](None) is None
    assert compat.requested_weights_only() is None


def test_a_named_mesh_view_shares_its_process_group_and_the_root_finds_it_by_name() -> None:
    """``compat.name_mesh`` gives a 1-D mesh a second name over the same process group (``_flatten`` makes a new
    group every time, even over the ranks of an existing dim: one more NCCL communicator each), filed on the root
    mesh so that ``root[name]`` finds it, as a flattened dim (ModelParallelStrategy's ``mesh["data_parallel"]``).
    Pinned on torch's private ``DeviceMesh`` constructor arguments, ``_layout``, ``_dim_group_names`` and
    ``_flatten_mapping`` (2.11 and 2.13 lay out a flattened dim differently)."""
    from torch.distributed.device_mesh import init_device_mesh

    compat.init_fake_process_group(8)
    try:
        mesh = init_device_mesh("cpu", (1, 4, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
        groups = len(dist.distributed_c10d._world.pg_map)
        named = compat.name_mesh(mesh["dp_shard"], "data_parallel")
        assert len(dist.distributed_c10d._world.pg_map) == groups  # no new process group
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that slicing a flattened name from the root is deprecated
            found = mesh["data_parallel"]
        assert named.mesh_dim_names == found.mesh_dim_names == ("data_parallel",)
        assert found.get_group() is mesh["dp_shard"].get_group() and found.size() == 4
        assert found.mesh.tolist() == mesh["dp_shard"].mesh.tolist()
    finally:
        dist.destroy_process_group()


class _SignalsItself(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        if batch_idx == 1:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_take_over_sigterm_replaces_lightnings_handler_and_its_own_stop(tmp_path) -> None:
    """StopAgreement relies on: the handler Lightning registers after Strategy.setup is the connector's
    ``_sigterm_notifier_fn`` as found then, and ``trainer.received_sigterm`` is what makes Lightning's loops stop on
    their own. Taken over, the signal reaches our callback, the run goes on, and ``mark`` sets the flag."""
    trainer = _trainer(tmp_path, max_epochs=1)
    module, heard = _SignalsItself(), []
    mark = compat.take_over_sigterm(trainer, lambda: heard.append(True))
    trainer.fit(module, _data(4))
    assert heard == [True] and module.steps == 4 and not trainer.received_sigterm
    mark()
    assert trainer.received_sigterm


def test_lightnings_per_step_sigterm_broadcast_is_the_attribute_dropped() -> None:
    """Lightning 2.6 broadcasts the SIGTERM flag each step through ``self._broadcast_sigterm_tensor()`` (looked up on
    the loop, so an attribute set on one trainer's loop replaces it); Lightning 2.5 has no such broadcast."""
    import inspect

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    if hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"):
        assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    compat.drop_sigterm_broadcast(trainer)
    if hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"):
        assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None


def test_a_pipeline_target_split_is_a_view_and_its_inference_copy_is_not() -> None:
    """The pipeline runner tells real microbatch loss calls from the schedule's metadata inference by this: the
    schedule splits the target with ``tensor_split`` (views of it) and infers on a detached copy of one."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _split_tensor

    target = torch.arange(4)
    parts = _split_tensor(target, TensorChunkSpec(0), 4)
    assert all(compat.is_view_of(p, target) for p in parts)
    assert not compat.is_view_of(parts[0].detach().requires_grad_(False), target)


def test_slurm_requeue_handler_is_looked_up_on_the_connector_when_registered() -> None:
    """StopAgreement replaces ``_slurm_sigusr_handler_fn`` on the trainer's connector before Lightning registers its
    handlers: Lightning must take the handler from the connector at registration, not from the class."""
    import inspect

    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    source = inspect.getsource(_SignalConnector.register_signal_handlers)
    assert "self._slurm_sigusr_handler_fn" in source and "self._sigterm_notifier_fn" in source
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    heard = []
    compat.take_over_slurm_requeue_signal(trainer, lambda: heard.append(True))
    trainer._signal_connector._slurm_sigusr_handler_fn(10, None)
    assert heard == [True]


_FLIGHT_RECORDER_SNIPPET = """
import os, json, sys
from datetime import timedelta
os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from cuboid import compat
from cuboid.compat import attention as compat_attention
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(sys.argv[2], 2),
                        timeout=timedelta(seconds=7))
mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))  # "b": a one-rank group per rank
group = mesh["b"].get_group()
dist.all_reduce(torch.ones(2), group=group)
compat.set_group_timeout(group, timedelta(seconds=3))
dist.all_gather_into_tensor(torch.empty(2), torch.ones(2), group=group)
entries = compat.flight_recorder_entries()
keep = ("ring", "process_group", "profiling_name", "collective_seq_id", "retired", "timeout_ms", "input_sizes")
nccl = compat.flight_recorder_dump("nccl")  # NCCL's own recorder: only in CUDA builds, empty without NCCL groups
print(json.dumps({"entries": [{k: e[k] for k in keep} for e in entries], "dump": len(compat.flight_recorder_dump()),
                  "nccl": None if nccl is None else len(__import__("pickle").loads(nccl).get("entries", [])),
                  "group": group.group_name}), flush=True)
dist.barrier()
os._exit(0)  # not what is tested: a gloo group's teardown at exit crashed once in CI ("terminate called ...")
"""


def test_flight_recorder_entries_and_group_timeouts(tmp_path) -> None:
    """The hang report and the ledger rely on: with ``TORCH_FR_BUFFER_SIZE`` set before the first collective, the flight recorder
    keeps gloo collectives with their group's name and description (``mesh_<dim>``), kind, per-group sequence
    number and timeout; a mesh dimension's group starts with torch's default timeout (30 min on gloo, not the
    ``init_process_group`` one) and ``set_group_timeout`` changes it. Two fresh processes (the recorder reads its
    size once per process)."""
    import json
    import subprocess

    cmd = [sys.executable, "-c", _FLIGHT_RECORDER_SNIPPET]
    procs = [subprocess.Popen([*cmd, str(r), str(tmp_path / "store")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
    facts = json.loads(outs[0][0].strip().splitlines()[-1])
    mine = [e for e in facts["entries"] if e["process_group"][0] == facts["group"]]
    assert [e["process_group"][1] for e in mine] == ["mesh_b", "mesh_b"]
    assert [e["profiling_name"] for e in mine] == ["gloo:all_reduce", "gloo:all_gather"]
    assert [e["collective_seq_id"] for e in mine] == [1, 2]
    assert [e["timeout_ms"] for e in mine] == [30 * 60 * 1000, 3000]
    assert mine[0]["input_sizes"] == [[2]] and facts["dump"] > 0
    # gloo writes the generic recorder; NCCL's own (read too, on NCCL) exists in CUDA builds only, empty here
    assert {e["ring"] for e in facts["entries"]} == {"fr"} and facts["nccl"] in (None, 0), facts["nccl"]


def test_batch_progress_flags_end_an_epoch_and_tell_the_last_batch(tmp_path) -> None:
    """EvenBatches relies on, for a loader without a length: ``train_batch_is_last`` is True on its last batch at
    on_train_batch_start; ``end_train_epoch_after_this_batch`` there ends the epoch after that batch, with the
    optimizer step and the epoch-end validation as at a real end; ``evaluation_batch_is_last`` is True on the last
    validation batch."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.randn(1, 2),) for _ in range(4)])

    seen: dict[str, list] = {"train_last": [], "val_last": []}

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen["train_last"].append(compat.train_batch_is_last(trainer))
            if trainer.current_epoch == 1 and batch_idx == 1:
                compat.end_train_epoch_after_this_batch(trainer)

        def on_validation_batch_start(self, trainer, *args) -> None:
            seen["val_last"].append(compat.evaluation_batch_is_last(trainer))

    class WithVal(_Recorder):
        def validation_step(self, batch, batch_idx):
            return None

    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[Watch()], enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(WithVal(), DataLoader(Stream(), batch_size=None), _data(2))
    assert seen["train_last"] == [False, False, False, True, False, False]
    assert trainer.global_step == 6
    assert seen["val_last"] == [False, True, False, True]  # validation ran at the end of both epochs


def test_torch_function_modes_lists_the_active_modes_outermost_first() -> None:
    from torch.overrides import TorchFunctionMode

    class A(TorchFunctionMode):
        pass

    outer, inner = A(), A()
    assert compat.torch_function_modes() == []
    with outer, inner:
        assert compat.torch_function_modes() == [outer, inner]


def test_tensor_version_counts_in_place_changes_but_not_batchnorms_kernel() -> None:
    """The buffer broadcast reads torch's version counter: an in-place op counts; BatchNorm's kernel updates its
    running statistics uncounted and counts ``num_batches_tracked`` (why whole modules are sent)."""
    buf = torch.zeros(3)
    before = compat.tensor_version(buf)
    buf.add_(1)
    assert compat.tensor_version(buf) == before + 1
    bn = nn.BatchNorm1d(4)
    versions = [compat.tensor_version(b) for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    bn(torch.randn(8, 4))
    after = [compat.tensor_version(b) for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    assert after[2] == versions[2] + 1 and after[:2] == versions[:2]


def test_sync_batchnorm_reaches_the_strategy_as_layer_sync() -> None:
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    from cuboid import CuboidStrategy

    trainer = L.Trainer(strategy=CuboidStrategy(), accelerator="cpu", devices=2, sync_batchnorm=True, logger=False)
    assert isinstance(compat.layer_sync(trainer.strategy), TorchSyncBatchNorm)
    trainer = L.Trainer(strategy=CuboidStrategy(), accelerator="cpu", devices=2, logger=False)
    assert compat.layer_sync(trainer.strategy) is None


def test_pending_checkpoint_is_the_path_the_run_will_restore_known_at_setup(tmp_path) -> None:
    """Cuboid skips weight initialization when a checkpoint is about to overwrite it: at ``setup`` (before
    ``configure_model`` and the strategy's setup) the path ``fit``/``validate`` will restore must be readable, and
    ``None`` when there is none; outside a run it is UNKNOWN (then Cuboid initializes, as if none came)."""

    class Seen(_Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.pending: list[object] = []

        def setup(self, stage: str) -> None:
            self.pending.append(compat.pending_checkpoint(self.trainer))

        def validation_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

    first = Seen()
    trainer = _trainer(tmp_path, max_steps=1, enable_checkpointing=False)
    trainer.fit(first, _data())
    assert first.pending == [None]
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    for method in ("fit", "validate"):
        again = Seen()
        getattr(_trainer(tmp_path, max_steps=2), method)(again, _data(), ckpt_path=str(tmp_path / "a.ckpt"))
        assert again.pending == [str(tmp_path / "a.ckpt")], (method, again.pending)
    assert compat.pending_checkpoint(trainer) is compat.UNKNOWN


def test_dtensor_rng_tracker_is_the_one_dtensors_dispatcher_reads_and_makes() -> None:
    """compat.start_dtensor_rng sets torch.distributed.tensor._random._rng_tracker (an OffsetBasedRNGTracker made
    with run_state_sync) so that DTensor's dispatcher, which makes one lazily when that is unset, does not. Pinned:
    the name the dispatcher reads, the class and its argument; on a CPU mesh nothing is made (no tracker there)."""
    import inspect

    from torch.distributed.tensor import _dispatch, _random
    from torch.distributed.tensor.device_mesh import init_device_mesh

    assert "random._rng_tracker" in inspect.getsource(_dispatch) and _random._rng_tracker is None
    assert "run_state_sync" in inspect.signature(_random.OffsetBasedRNGTracker).parameters
    compat.init_fake_process_group(2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that CPU meshes have no DTensor random support
            assert compat.start_dtensor_rng(init_device_mesh("cpu", (2,))) is False
        assert _random._rng_tracker is None
    finally:
        dist.destroy_process_group()


def test_attention_kernels_return_the_rows_log_sum_exp_and_take_it_back() -> None:
    """The aten ops ``cuboid.context.blocks`` calls (through ``compat.lse_attention``): their schemas as written
    there (the CUDA ones cannot run here: their argument order and keywords are what this pins), and on CPU the
    values: the output is ``scaled_dot_product_attention``'s (grouped-query heads as they come, causal, with the
    padding of a ``(batch, keys)`` mask), the log-sum-exp is that of the scaled scores, and the backward given the
    output and log-sum-exp gives autograd's gradients."""
    schemas = compat_attention.op_schemas()
    assert (
        "Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)"
        in (schemas["aten::_scaled_dot_product_flash_attention_for_cpu"])
    )
    assert schemas["aten::_flash_attention_forward"].startswith(
        "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, "
        "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None, "
        "SymInt? window_size_left=None, SymInt? window_size_right=None, "
    )
    assert schemas["aten::_flash_attention_backward"] == (
        "aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor "
        "logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
        "Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? window_size_left=None, SymInt? "
        "window_size_right=None) -> (Tensor, Tensor, Tensor)"
    )
    assert schemas["aten::_efficient_attention_forward"].startswith(
        "aten::_efficient_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? bias, Tensor? cu_seqlens_q, "
        "Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, float dropout_p, int custom_mask_type, bool "
        "compute_log_sumexp=False, *, float? scale=None"
    )
    assert schemas["aten::_efficient_attention_backward"].startswith(
        "aten::_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key, Tensor value, Tensor? bias, "
        "Tensor out, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor "
        "logsumexp, float dropout_p, Tensor philox_seed, Tensor philox_offset, int custom_mask_type, bool "
        "bias_requires_grad, *, float? scale=None"
    )
    cpu_backward = (
        "(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, float dropout_p, "
        "bool is_causal, *, Tensor? attn_mask=None, float? scale=None)"
    )
    assert cpu_backward in schemas["aten::_scaled_dot_product_flash_attention_for_cpu_backward"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, 2, 8, 16, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    real = torch.ones(2, 8, dtype=torch.bool)
    real[1, 5:] = False
    assert compat.lse_kernel(q, padded=True) == "cpu_flash" and compat.lse_kernel(q, softcap=True) == "cpu_softcap"
    with pytest.raises(compat.KernelUnavailable, match="dropout"):
        compat.lse_kernel(q, dropout_p=0.1)
    causal = compat.BlockShape(causal=True)
    out, lse, saved = compat.lse_attention("cpu_flash", q, k, v, causal, real, None)
    mask = real[:, None, None, :] & torch.ones(8, 8, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4.0
    assert torch.allclose(out, want, atol=1e-12)
    assert torch.allclose(lse, scores.masked_fill(~mask, float("-inf")).logsumexp(-1), atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = compat.lse_attention_backward("cpu_flash", grad, q, k, v, out, lse, causal, real, None, saved)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(got, want_grads, strict=True))


def test_a_window_is_flash_attentions_own_bottom_right_aligned_left_and_right() -> None:
    """``compat.window_mask`` states FlashAttention's local window (``_flash_attention_forward``'s
    ``window_size_left``/``window_size_right``; torch 2.11 and 2.13's ``flash_api.cpp``, FA2's ``mask.h``): row ``i``
    of ``rows`` sees key ``j`` of ``keys`` when ``i + keys - rows - left <= j <= i + keys - rows + right``."""
    seen = compat.window_mask(3, 5, 1, 0)  # bottom-right aligned: the last row sees the last key and one before
    assert seen.int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert compat.window_mask(2, 3, 0, None).int().tolist() == [[0, 1, 1], [0, 0, 1]]
    assert compat.window_mask(2, 2, None, 0).int().tolist() == [[1, 0], [1, 1]]  # causal


def test_soft_capped_blocks_written_out_and_by_recompute_give_autograds_gradients() -> None:
    """The soft-capped kernels (Gemma 2's ``softcap * tanh(s / softcap)``): on CPU written out with a backward by
    hand; on CUDA, FlexAttention's forward (its eager form runs here, forward only: its values and its natural-log
    log-sum-exp) and a backward by recomputing the block under autograd. Both backwards, given the merged output and
    log-sum-exp of two blocks of keys, sum to autograd's gradients of attention over all the keys."""
    from cuboid.compat.softcap import _backward_by_recompute, _flex_call, _softcapped, _softcapped_backward

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, 16, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, 2, 16, 16, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    real = torch.ones(2, 16, dtype=torch.bool)
    real[0, :3] = False
    cap = 2.0
    scores = torch.tanh(q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4.0 / cap) * cap
    seen = real[:, None, None, :] & compat.window_mask(8, 16, None, 0)  # causal, bottom-right: the last 8 keys
    scores = scores.masked_fill(~seen, float("-inf"))
    want = torch.softmax(scores, -1) @ v.repeat_interleave(2, 1)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    # two blocks: keys 0..7 every row sees, 8..15 the diagonal
    blocks = [(0, 8, compat.BlockShape()), (8, 16, compat.BlockShape(causal=True))]
    parts = [_softcapped(q, k[:, :, a:b], v[:, :, a:b], shape, real[:, a:b], None, cap) for a, b, shape in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(torch.exp(part_lse - lse).unsqueeze(-1) * part_out for part_out, part_lse in parts)
    assert torch.allclose(out, want, atol=1e-12)
    for backward in ("by hand", "by recompute"):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, shape in blocks:
            block_k, block_v, mine = k[:, :, a:b], v[:, :, a:b], real[:, a:b]
            if backward == "by hand":
                got = _softcapped_backward(grad, q, block_k, block_v, out, lse, shape, mine, None, cap)
            else:

                def forward(q_, k_, v_, shape=shape, mine=mine):
                    return _softcapped(q_, k_, v_, shape, mine, None, cap)

                got = _backward_by_recompute(forward, grad, q, block_k, block_v, out, lse)
            dq += got[0]
            dk[:, :, a:b] += got[1]
            dv[:, :, a:b] += got[2]
        for name, a, b in zip("qkv", (dq, dk, dv), want_grads, strict=True):
            assert torch.allclose(a, b, atol=1e-10), (backward, name, (a - b).abs().max())
    with torch.no_grad():  # FlexAttention's eager forward (no backward on CPU): the same block, the same log-sum-exp
        q32, k32, v32 = (t.detach().float() for t in (q, k, v))
        shape = compat.BlockShape(causal=True)
        with warnings.catch_warnings(record=True) as caught:  # the log-sum-exp asked as torch 2.11-2.13 ask it
            warnings.simplefilter("always")
            flex_out, flex_lse = _flex_call(
                q32, k32[:, :, 8:], v32[:, :, 8:], shape, real[:, 8:], None, cap, compiled=False
            )
        assert not [w for w in caught if "deprecated" in str(w.message)], [str(w.message) for w in caught]
        mine_out, mine_lse = _softcapped(q32, k32[:, :, 8:], v32[:, :, 8:], shape, real[:, 8:], None, cap)
    assert torch.allclose(flex_out, mine_out, atol=1e-5) and torch.allclose(flex_lse, mine_lse, atol=1e-5)


def test_single_tensor_collectives_take_the_names_this_torch_does_not_deprecate() -> None:
    """torch 2.13 warns (FutureWarning) on ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` and names them
    ``*_single``; torch 2.11 has only the old names. ``compat`` calls whichever this torch has, without a warning."""
    group = dist.new_group([0], backend="gloo") if dist.is_initialized() else None
    if group is None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = torch.empty(3)
            compat.all_gather_single(out, torch.arange(3.0), group=group)
            mine = torch.empty(3)
            compat.reduce_scatter_single(mine, out, group=group)
    finally:
        if group is None:
            dist.destroy_process_group()
    assert mine.tolist() == [0.0, 1.0, 2.0]
    assert hasattr(dist, "all_gather_single") == (torch.__version__ >= "2.13")


def test_litdata_streaming_dataset_deals_over_the_ranks_its_distributed_env_names(tmp_path, monkeypatch) -> None:
    """compat.deal_over_data_parallel sets litdata's ``StreamingDataset.distributed_env`` (a ``_DistributedEnv``):
    the dataset's length and the chunks it reads follow it, and its iteration does not detect the ranks again."""
    litdata = pytest.importorskip("litdata")
    from litdata.streaming.writer import BinaryWriter

    monkeypatch.setattr("litdata.helpers._get_newer_version", lambda version: None)  # it asks PyPI otherwise

    writer = BinaryWriter(str(tmp_path), chunk_size=8)
    for i in range(32):
        writer[i] = i
    writer.done()
    writer.merge()
    read = []
    for rank in (0, 1):
        dataset = litdata.StreamingDataset(str(tmp_path))
        loader = torch.utils.data.DataLoader(dataset, batch_size=4)
        assert compat.deal_over_data_parallel(loader, 2, rank) and len(dataset) == 16
        read.append([int(i) for batch in loader for i in batch])
    assert len(read[0]) == len(read[1]) == 16 and sorted(read[0] + read[1]) == list(range(32)), read
    assert not compat.deal_over_data_parallel(torch.utils.data.DataLoader(list(range(4))), 2, 0)


def test_lightning_seeds_workers_by_the_global_rank_and_cuboid_swaps_in_the_data_parallel_one(monkeypatch) -> None:
    """compat.seed_workers_by_data_rank: ``seed_everything(workers=True)`` sets ``PL_SEED_WORKERS=1``, and Fabric's
    ``setup_dataloaders`` gives the loader ``partial(pl_worker_init_function, rank=<global rank>)`` before the
    strategy's ``process_dataloader`` sees it (the Trainer does the same after it; tests/job/test_hangs.py trains
    that path). Cuboid swaps the rank for the data-parallel one, sets it where the Trainer would, and leaves a
    ``worker_init_fn`` of the user's own and unseeded runs alone."""
    import os
    from functools import partial

    from lightning.fabric.utilities.seed import pl_worker_init_function

    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    L.seed_everything(1, workers=True, verbose=False)
    assert os.environ["PL_SEED_WORKERS"] == "1"
    fabric = L.Fabric(accelerator="cpu", devices=1)
    seen = []
    monkeypatch.setattr(
        fabric.strategy, "process_dataloader", lambda loader: seen.append(loader.worker_init_fn) or loader
    )
    fabric.setup_dataloaders(DataLoader(list(range(4)), num_workers=1))
    assert isinstance(seen[0], partial) and seen[0].func is pl_worker_init_function and seen[0].keywords == {"rank": 0}
    swapped = compat.seed_workers_by_data_rank(DataLoader(list(range(4)), worker_init_fn=seen[0]), 3)
    assert swapped.worker_init_fn.func is pl_worker_init_function and swapped.worker_init_fn.keywords == {"rank": 3}
    assert compat.seed_workers_by_data_rank(DataLoader(list(range(4))), 2).worker_init_fn.keywords == {"rank": 2}

    def own(worker_id: int) -> None:
        pass

    assert compat.seed_workers_by_data_rank(DataLoader(list(range(4)), worker_init_fn=own), 3).worker_init_fn is own
    L.seed_everything(1, workers=False, verbose=False)
    assert compat.seed_workers_by_data_rank(DataLoader(list(range(4))), 3).worker_init_fn is None


def test_set_num_threads_if_needed_gives_each_process_its_share_of_the_cores(monkeypatch) -> None:
    """compat.set_num_threads_if_needed is Lightning's private ``_set_num_threads_if_needed``: with
    ``OMP_NUM_THREADS`` unset it sets torch's threads (and the variable) to the node's cores over its processes, as
    Lightning's launchers do for DDP; set, it leaves both alone (tests/parallel/test_plain_module.py checks each rank
    of a launch)."""
    import os

    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
        compat.set_num_threads_if_needed(2)
        assert torch.get_num_threads() == before
        monkeypatch.delenv("OMP_NUM_THREADS")
        compat.set_num_threads_if_needed(2)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = max(1, cores // 2)
        assert _suggested_max_num_threads(2) == share
        assert torch.get_num_threads() == share and os.environ["OMP_NUM_THREADS"] == str(share)
    finally:
        torch.set_num_threads(before)


def test_fsdp_unreduced_sees_hsdps_deferred_all_reduce() -> None:
    """compat.fsdp_unreduced reads FSDP2's per-group ``_partial_reduce_output``: under HSDP (here a 1 x 1 mesh in one
    process, which takes HSDP's code path), a backward with ``set_requires_all_reduce(False)`` leaves the
    reduce-scattered gradient there, unreduced across replicas; the next backward that all-reduces folds it in and
    clears it (cuboid.step.accumulation refuses a step that ends with one left)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        model = fully_shard(nn.Linear(4, 2), mesh=mesh)
        x = torch.randn(3, 4)
        model.set_requires_all_reduce(False)
        model(x).sum().backward()
        assert compat.fsdp_unreduced(model) and model.weight.grad is None
        model.set_requires_all_reduce(True)
        model(x).sum().backward()
        assert not compat.fsdp_unreduced(model)
        expected = 2 * x.sum(0).expand(2, 4)  # both backwards' gradients, the deferred one folded in
        assert torch.allclose(model.weight.grad.full_tensor(), expected)
    finally:
        if started:
            dist.destroy_process_group()


def test_dcp_writes_and_reads_through_fsspec_with_storage_options() -> None:
    """compat.fsspec_writer / fsspec_reader (torch's private FsspecWriter and FsspecReader): built with a URL and
    fsspec storage options, used without a checkpoint_id, a save and a load round-trip on fsspec's in-memory file
    system, in one process; the options reach the file system, and the writer does not sync the whole host."""
    import uuid

    import torch.distributed.checkpoint as dcp

    from cuboid import compat

    url = f"memory://compat-{uuid.uuid4().hex}/ckpt"
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=compat.fsspec_writer(url, {}))
        back = {"w": torch.zeros(2, 3)}
        dcp.load(back, storage_reader=compat.fsspec_reader(url, {}))
    assert torch.equal(back["w"], state["w"])
    assert "w" in compat.fsspec_reader(url, {}).read_metadata().state_dict_metadata
    writer, reader = compat.fsspec_writer(url, {"marker": "w"}), compat.fsspec_reader(url, {"marker": "r"})
    assert writer.fs.fs.storage_options == {"marker": "w"} and writer.sync_files is False
    assert reader.fs.fs.storage_options == {"marker": "r"}


def test_transformers_renames_what_it_saves_as_cuboid_reads_it() -> None:
    """``compat.hf.saved_names`` asks transformers' loading code (``get_model_conversion_mapping``,
    ``rename_source_key``) under which key a model's weight is saved: LLaVA keeps its language model's under
    ``language_model.model.*`` and its head under ``language_model.lm_head``; a Llama is saved under its own names."""
    transformers = pytest.importorskip("transformers")
    from cuboid.compat.hf import saved_names

    text = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=8, patch_size=4)  # fmt: skip
    llava = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=63)
    )
    saved = ["language_model.model.layers.0.self_attn.q_proj.weight", "language_model.lm_head.weight",
             "vision_tower.vision_model.embeddings.patch_embedding.weight"]  # fmt: skip
    got = saved_names(llava, saved)
    assert got["model.language_model.layers.0.self_attn.q_proj.weight"] == saved[0]
    assert got["lm_head.weight"] == saved[1]
    assert set(got.values()) == set(saved) and set(got) <= set(llava.state_dict())
    llama = transformers.LlamaForCausalLM(text)
    assert saved_names(llama, ["model.layers.0.self_attn.q_proj.weight"]) == {}


def test_fully_shard_undone_leaves_the_users_class_plain_parameters_and_no_fsdp_state() -> None:
    """What ``compat.unshard_for_good`` takes away is what this torch's ``fully_shard`` installs (the names in
    ``cuboid/compat/fsdp.py``): afterwards the module is its own class, pickles, has plain parameters with the
    values it had (tied ones still tied), no FSDP hooks (``state_dict`` and ``forward`` leave it alone), no
    ``register_fsdp_forward_method`` wrapper, and ``fully_shard`` takes it again."""
    import pickle

    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4))
        model[1].weight = model[0].weight  # tied, within the root's unit
        before = {k: v.clone() for k, v in model.state_dict().items()}
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        register_fsdp_forward_method(model, "extra_repr")
        assert "extra_repr" in vars(model) and type(model).__name__ == "FSDPSequential"
        model(torch.ones(2, 4)).sum().backward()
        whole = compat.unshard_for_good(model, torch.device("cpu"))
        assert len(whole) == 4  # the tied weight once, a bias, the last layer's two
        assert type(model) is torch.nn.Sequential and type(model[2]) is torch.nn.Linear
        assert not any(isinstance(m, FSDPModule) for m in model.modules())
        assert "extra_repr" not in vars(model)
        for m in (model, model[2]):
            assert STATE_KEY not in vars(m) and REGISTRY_KEY not in vars(m) and m not in _module_state_mapping
            assert not m._forward_pre_hooks and not m._forward_hooks and not m._state_dict_pre_hooks
        assert model[1].weight is model[0].weight
        state = model.state_dict()
        assert all(type(v) is torch.Tensor for v in state.values())
        assert state.keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in state.items())
        assert type(pickle.loads(pickle.dumps(model))) is torch.nn.Sequential
        fully_shard(model, mesh=mesh)  # the registry is clear: it shards again
        assert isinstance(model, FSDPModule)
    finally:
        if started:
            dist.destroy_process_group()


def _count_call(module: torch.nn.Module, args: tuple) -> None:
    module.calls = getattr(module, "calls", 0) + 1


def test_tensor_parallels_hooks_are_told_apart_and_dropped_with_its_dtensors_made_whole() -> None:
    """``parallelize_module`` keeps no handle for the hooks it registers: ``compat.hook_keys`` before and after
    names them (a hook the user had stays), ``compat.drop_hooks`` removes them from every table
    (``with_kwargs`` companions included), and ``unshard_for_good`` makes its DTensor parameters plain, so the
    module computes what it did, on plain tensors, and pickles."""
    import pickle

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        model[0].register_forward_pre_hook(_count_call)  # the user's own: it stays
        x = torch.randn(3, 4)
        want = model(x)
        before = compat.hook_keys(model)
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        after = compat.hook_keys(model)
        added = {m: {t: keys - before[m][t] for t, keys in tables.items()} for m, tables in after.items()}
        assert all(added[model[i]]["_forward_pre_hooks"] for i in (0, 2)), added  # tensor parallel's input hooks
        assert isinstance(model[0].weight, DTensor)
        compat.unshard_for_good(model, torch.device("cpu"))
        compat.drop_hooks(added)
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        assert len(model[0]._forward_pre_hooks) == 1 and not model[2]._forward_pre_hooks
        assert not model[0]._forward_hooks and not model[2]._forward_hooks
        got = model(x)
        assert type(got) is torch.Tensor and torch.allclose(got, want) and model[0].calls == 2
        assert type(pickle.loads(pickle.dumps(model))) is torch.nn.Sequential
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert isinstance(model[0].weight, DTensor)  # distribute_module's once-only mark went with the DTensors
    finally:
        if started:
            dist.destroy_process_group()


def test_lightning_keeps_the_sampler_it_wraps_and_a_loader_can_turn_batching_off_again() -> None:
    """What :func:`cuboid.compat.wrapped_sampler` and :func:`cuboid.compat.batch_per_sample` read and change:
    Lightning's ``DistributedSamplerWrapper`` keeps the sampler it wraps in ``dataset._sampler``; a loader made with
    batching on, turned off in place, yields exactly what ``DataLoader(..., batch_size=None)`` yields."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

    from cuboid import compat

    data = TensorDataset(torch.arange(24.0).view(12, 2))
    inner = BatchSampler(SequentialSampler(data), batch_size=3, drop_last=False)
    wrapper = DistributedSamplerWrapper(inner, num_replicas=2, rank=1, shuffle=False)
    rebuilt = DataLoader(data, sampler=wrapper)  # torch's default batch_size=1 around a batch-yielding sampler
    assert compat.wrapped_sampler(rebuilt) == (wrapper, inner)
    assert [b[0].shape for b in rebuilt] == [torch.Size([1, 3, 2])] * 2
    compat.batch_per_sample(rebuilt)
    wanted = DataLoader(data, sampler=wrapper, batch_size=None)
    assert (rebuilt.batch_size, rebuilt.batch_sampler, rebuilt.sampler) == (None, None, wrapper)
    got, expected = list(rebuilt), list(wanted)
    assert len(got) == len(rebuilt) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(got, expected, strict=True))
    assert got[0][0].tolist() == [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]  # rank 1's first batch: samples 3, 4, 5
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        rebuilt.batch_size = 4  # torch's guard is back up


def test_lightnings_averaging_callbacks_keep_their_whole_copy_where_compat_reads_it() -> None:
    """:func:`cuboid.compat.averaged_copies`: ``WeightAveraging`` keeps an ``AveragedModel`` as ``_average_model``
    (the copy its ``module``), ``StochasticWeightAveraging`` a deepcopy of the LightningModule there; both made in
    the callbacks' ``setup``."""
    from types import SimpleNamespace

    import lightning as L
    from lightning.pytorch import callbacks

    from cuboid import compat

    module = L.LightningModule()
    module.layer = nn.Linear(2, 2)
    made = [callbacks.StochasticWeightAveraging(swa_lrs=0.01)]
    if hasattr(callbacks, "EMAWeightAveraging"):  # Lightning 2.6 on (the floor, 2.5.0, has SWA only)
        made.append(callbacks.EMAWeightAveraging(decay=0.9))
    assert compat.averaged_copies(made) == []  # not made before setup
    trainer = SimpleNamespace(strategy=object())  # SWA asks the strategy's type
    for callback in made:
        callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    copies = compat.averaged_copies(made)
    assert len(copies) == len(made) and all(type(c) is type(module) and c is not module for c in copies)
    assert all(torch.equal(c.layer.weight, module.layer.weight) for c in copies)


def test_dtensor_beside_a_plain_tensor_raises_the_mixed_error_kept_reads() -> None:
    """``cuboid.dropin.kept`` gathers a kept-sharded model for a library's method only when the method meets a
    sharded weight beside a plain tensor: it recognizes DTensor's dispatch error by ``compat.MIXED_TENSORS``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        weight = DTensor.from_local(torch.ones(2, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(RuntimeError, match=compat.MIXED_TENSORS):
            torch.nn.functional.linear(torch.ones(4, 3), weight)
    finally:
        if started:
            dist.destroy_process_group()


def test_fake_steps_count_what_real_steps_hold_and_the_rnn_workspace_is_restored() -> None:
    """``compat.LiveBytes`` on fake tensors (the planner's input) against torch's MemTracker on real ones: a
    Linear stack's forward keeps the same bytes. torch's meta kernel for oneDNN's RNN layer returns an empty
    workspace; ``compat.tracing`` puts the real kernel's back, which is linear in the batch (checked here)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    with compat.track_memory(net) as mem:
        net(x).sum()
        real = mem.current()["Activation"]
    mode = compat.fake_mode()
    with mode:
        fx = mode.from_tensor(x)
        fnet = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))  # fake parameters, as the planner's
    live = compat.LiveBytes(0, fnet.parameters())  # the weights' views (saved for backward) are not new bytes
    with mode, live:
        out = fnet(fx).sum()
        fake = live.live
    del out
    assert fake == pytest.approx(real, rel=0.05), (fake, real)
    lstm = nn.LSTM(16, 32, batch_first=True)
    with mode:
        flstm = nn.LSTM(16, 32, batch_first=True)
    sizes = []
    for batch in (2, 5):
        with mode:
            fx = mode.from_tensor(torch.zeros(batch, 10, 16))
        live = compat.LiveBytes(0)
        with mode, live:
            flstm(fx)
            sizes.append(live.peak)
    real_ws = []
    for batch in (2, 5):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Grab(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                if func is torch.ops.aten.mkldnn_rnn_layer.default:
                    real_ws.append(out[3].numel())
                return out

        with Grab():
            lstm(torch.zeros(batch, 10, 16))
    assert real_ws[1] > real_ws[0] > 0
    # from 2 to 5 samples the fake step grows by the real workspace's growth and its outputs' (with the meta's
    # empty workspace: by the outputs' alone, 22,272 bytes here against the workspace's 61,440)
    assert real_ws[1] - real_ws[0] <= sizes[1] - sizes[0] <= 2 * (real_ws[1] - real_ws[0]), (sizes, real_ws)


def test_real_data_beside_fake_weights_and_the_grouped_gemm_shape() -> None:
    """``compat.RealData`` over a fake mode: an operator on real tensors only runs for real (a count read with
    ``.item()``), a real boolean mask indexes a fake tensor, and an fp32 grouped GEMM, which torch's meta kernel
    refuses (CUDA's bf16-only check), is shaped as the CPU kernel's result."""
    import torch.nn.functional as F

    mode = compat.fake_mode()
    ids = torch.tensor([[1, 5, 5, 2]])
    with mode:
        weight = torch.empty(8, 3)
    with mode, compat.RealData():
        count = int((ids == 5).sum().item())  # no DataDependentOutputException: the ids are real
        picked = weight[ids[0] > 1]  # rows where the mask is true: 3 of them
    assert count == 2 and picked.shape == (3, 3)
    a, b = torch.randn(10, 16), torch.randn(3, 16, 32)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    real = F.grouped_mm(a, b, offs=offs)
    with mode:
        fa, fb, foffs = mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(offs)
        with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            F.grouped_mm(fa, fb, offs=foffs)  # the meta kernel's rule (remove the shaping when this passes)
    with mode, compat.RealData():
        shaped = F.grouped_mm(fa, fb, offs=foffs)
    assert shaped.shape == real.shape and shaped.dtype == real.dtype


def test_torchs_muon_orthogonalizes_through_the_module_function_and_its_step_hook_wrapper() -> None:
    """``compat.muon_newton_schulz``: torch's Muon step calls ``torch.optim._muon._zeropower_via_newtonschulz``
    once per matrix, by module lookup (replaced inside the context, torch's own again after). ``compat.unhooked_step``:
    once a Muon exists its class's ``step`` is torch's hook wrapper (``hooked``), and the function under it."""
    import torch.optim._muon as muon

    p = torch.nn.Parameter(torch.randn(6, 4))
    p.grad = torch.randn(6, 4)
    opt = torch.optim.Muon([p], lr=0.1)
    seen = []

    def orthogonalize(update, *args):
        seen.append(tuple(update.shape))
        return compat.muon_newton_schulz.original(update, *args)

    with compat.muon_newton_schulz(orthogonalize):
        opt.step()
    assert seen == [(6, 4)] and muon._zeropower_via_newtonschulz is compat.muon_newton_schulz.original
    assert getattr(torch.optim.Muon.step, "hooked", False)
    assert not getattr(compat.unhooked_step(torch.optim.Muon.step), "hooked", False)


def test_the_autograd_graph_task_and_a_pipeline_stages_shape_inference_are_told() -> None:
    """``compat.in_backward``: false in a forward, true inside a backward (a checkpointed recompute runs there);
    ``compat.watch_metadata_inference``: torch's PipelineStage has ``_prepare_forward_infra`` and
    ``_prepare_backward_infra``, and the forwards they run are marked."""
    from torch.distributed.pipelining.stage import PipelineStage

    inside = []
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: inside.append(compat.in_backward()) or g)
    assert not compat.in_backward()
    y.sum().backward()
    assert inside == [True] and not compat.in_backward()
    assert callable(PipelineStage._prepare_forward_infra) and callable(PipelineStage._prepare_backward_infra)

    class Stage:  # the two methods as torch's stage has them: each runs the module's forward
        def _prepare_forward_infra(self, *args, **kwargs):
            return compat.counted_forward()

        def _prepare_backward_infra(self, *args, **kwargs):
            return compat.counted_forward()

    stage = Stage()
    compat.watch_metadata_inference(stage)
    assert stage._prepare_forward_infra() is False and stage._prepare_backward_infra(1) is False
    assert compat.counted_forward()
