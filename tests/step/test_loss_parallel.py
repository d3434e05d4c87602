"""Loss parallel's cross-entropy (cuboid.step.loss_parallel): over vocabulary-sharded logits it hands the step a
plain tensor of its own, not ``to_local()``'s view, so FSDP2 has no view to warn about at every step's output
(issue 67, item 9: "FSDP2-wrapped module (FSDPCausalLM) returned a view tensor" at tp2, every rank, every step)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from cuboid.step import LossParallel


def test_the_loss_over_sharded_logits_is_plain_and_no_view_and_equals_the_whole_ones() -> None:
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(6, 10, generator=g, requires_grad=True)
        target = torch.randint(0, 10, (6,), generator=g)
        sharded = distribute_tensor(logits, init_device_mesh("cpu", (1,)), [Shard(-1)])
        parallel = LossParallel()
        parallel.enabled = True
        lm = torch.nn.Module()
        lm.log, lm.log_dict = (lambda *a, **k: None), (lambda *a, **k: None)
        with parallel.step(lm):
            loss = F.cross_entropy(sharded, target)
        assert type(loss) is torch.Tensor and not isinstance(loss, DTensor)
        assert loss._base is None  # to_local() gives a view (its _base the DTensor's local tensor)
        whole = logits.detach().requires_grad_()
        want = F.cross_entropy(whole, target)
        assert torch.allclose(loss, want)
        with parallel.backward():  # the gradient still reaches the sharded logits (a leaf of its own) through the copy
            loss.backward()
        want.backward()
        assert sharded.grad is not None and torch.allclose(sharded.grad.full_tensor(), whole.grad)
    finally:
        if started:
            dist.destroy_process_group()
