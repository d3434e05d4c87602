"""No host tensor reaches a collective on a device group: NCCL serves the mesh's device only (torch's
``ProcessGroup::getBackend`` has no backend for ``cpu`` in a group made for ``cuda``), so a host tensor there fails
at the first call on a GPU, and nowhere on CPU, where every group is gloo. The paths that hold host tensors on a
device mesh are run here on fake CUDA tensors over a ``cuda`` mesh of torch's fake process group, and every
collective's tensors are read at the dispatcher (:class:`DeviceGroups`):

- ``cpu_offload=True``: FSDP2 keeps each parameter's shard on the host, a DTensor on the ``cuda`` mesh
  (``_fsdp_param.py``, ``_from_local_no_grad`` of the offloaded local tensor); a full-format save gathers it
  (``checkpoint/full.py``);
- stray parameters (outside every FSDP unit: FSDP2 ignores 0-d ones and leaves them where they were built, CPU
  offload materialized them on the host), whose gradients Cuboid all-reduces itself (``parallel/build.py``).

Fake CUDA tensors need a CUDA build of torch: CI's floor job runs this module on PyPI's torch 2.11 (a CUDA build that
runs on CPU); under the suite's CPU build of torch it is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from cuboid import compat

pytestmark = pytest.mark.skipif(
    not torch.cuda._is_compiled(),
    reason="fake CUDA tensors need a CUDA build of torch: CI's floor job runs this module on PyPI's torch 2.11",
)

WORLD = 2


class DeviceGroups(TorchDispatchMode):
    """Each collective (``c10d`` and ``_c10d_functional`` ops) that ran, with the device types of its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, set[str]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            leaves = pytree.tree_leaves((args, kwargs or {}))
            self.seen.append((func.__name__, {t.device.type for t in leaves if isinstance(t, torch.Tensor)}))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    """A ``cuda`` data-parallel mesh of two ranks on torch's fake process group (this process is rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh

    compat.init_fake_process_group(WORLD)
    try:
        yield init_device_mesh("cuda", (WORLD,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def _offloaded_shard(mesh: Any, shape: tuple[int, int]) -> Any:
    """A parameter as FSDP2 holds it under ``CPUOffloadPolicy``: this rank's dim-0 shard on the host, a DTensor on
    the ``cuda`` mesh (``FSDPParam._init_sharded_param``: ``_from_local_no_grad`` of the offloaded local tensor)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    local = torch.randn(shape[0] // WORLD, shape[1])
    meta = TensorMeta(torch.Size(shape), (shape[1], 1), torch.float32)
    return _from_local_no_grad(local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta))


def test_a_full_save_gathers_offloaded_shards_on_the_meshs_device(mesh: Any) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuboid.checkpoint.full import _gathered

    with FakeTensorMode(allow_non_fake_inputs=True):
        weight, moment = _offloaded_shard(mesh, (8, 6)), _offloaded_shard(mesh, (8, 6))
        assert weight.to_local().device.type == "cpu" and weight.device_mesh.device_type == "cuda"
        with DeviceGroups() as groups:
            share = _gathered({"state_dict": {"w": weight}, "optimizer": {"m": moment}}, keep=True)
    gathers = [name for name, _ in groups.seen]
    assert any(name.startswith("all_gather") for name in gathers), gathers
    assert all(devices == {"cuda"} for _, devices in groups.seen), groups.seen
    for whole in (share["state_dict"]["w"], share["optimizer"]["m"]):  # the file's copy: whole, on the host
        assert whole.shape == (8, 6) and whole.device.type == "cpu"


def test_a_stray_parameter_lives_on_the_training_device(mesh: Any) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuboid.parallel.build import _strays_to_device

    with FakeTensorMode(allow_non_fake_inputs=True):
        lm = nn.Module()
        lm.scale = nn.Parameter(torch.tensor(1.0))  # 0-d: FSDP2 ignores it and leaves it where it was built
        lm.head = nn.Module()
        lm.head.scale = lm.scale  # tied
        lm.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        _strays_to_device(lm, ["scale", "frozen"], torch.device("cuda"))
    assert lm.scale.device.type == lm.frozen.device.type == "cuda"
    assert lm.head.scale is lm.scale and lm.scale.requires_grad and not lm.frozen.requires_grad


def test_a_stray_gradient_kept_on_the_host_is_all_reduced_through_the_device(mesh: Any) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuboid.parallel.build import _average_stray_gradients

    with FakeTensorMode(allow_non_fake_inputs=True):
        lm = nn.Module()
        lm.scale = nn.Parameter(torch.tensor(1.0))
        _average_stray_gradients(lm, ["scale"], mesh, torch.device("cuda"))
        lm.scale.grad = torch.full((), 4.0)
        hooks = list(lm.scale._post_accumulate_grad_hooks.values())  # what autograd calls after accumulating
        with DeviceGroups() as groups:
            for hook in hooks:
                hook(lm.scale)
    assert [name for name, _ in groups.seen] == ["allreduce_.default"], groups.seen
    assert groups.seen[0][1] == {"cuda"}
    assert lm.scale.grad.device.type == "cpu"  # the gradient stays where it was, averaged in place
