"""Init that never holds the whole model, and plans checked on meta at full size.

* Meta init materializes one piece at a time on rank 0 (a block, or one module's own tensors) and still gives
  exactly the values of one full init (Cuboid's Llama, tied or not, and transformers' Llama).
* A tensor on meta that the model's init leaves unset is an error, not garbage.
* ``CausalLM(model="70b", meta_init=True)`` under dp8 x tp8 checks its plan and reports per-rank bytes on
  fake ranks, allocating nothing.
"""

from __future__ import annotations

import sys

import pytest
import torch
from harness import python
from torch import nn

from cuboid.models.llama import Llama, LlamaConfig
from cuboid.parallel import materialize

TIED = LlamaConfig(vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, tie_embeddings=True)


class Holder(nn.Module):
    """A LightningModule's shape: the model under ``model``."""

    def __init__(self, build) -> None:
        super().__init__()
        self.model = build()


def _streamed(build, blocks: set[str]) -> tuple[Holder, list[int]]:
    """Build on meta, materialize piece by piece (one process), recording rank 0's real bytes at each init."""
    torch.manual_seed(5)
    with torch.device("meta"):
        holder = Holder(build)
    on_meta = materialize.meta_names(holder)
    twins = materialize.meta_twins(holder)
    held: list[int] = []
    original = materialize.init_module

    def counting(module: nn.Module) -> None:
        real = {id(t): t for t in [*module.parameters(), *module.buffers()] if not t.is_meta}
        held.append(sum(t.numel() * t.element_size() for t in real.values()))
        original(module)

    materialize.init_module = counting
    try:
        materialize.materialize_streamed(holder, twins, on_meta, torch.device("cpu"), blocks)
    finally:
        materialize.init_module = original
    return holder, held


@pytest.mark.parametrize("cfg", [TIED, LlamaConfig(vocab_size=512, dim=64, n_layers=3)], ids=["tied", "untied"])
def test_llama_meta_init_equals_full_init_one_piece_at_a_time(cfg: LlamaConfig) -> None:
    holder, held = _streamed(lambda: Llama(cfg), {f"model.layers.{i}" for i in range(cfg.n_layers)})
    torch.manual_seed(5)
    eager = Llama(cfg)
    for name, tensor in eager.state_dict().items():
        assert torch.equal(holder.model.state_dict()[name], tensor), name
    if cfg.tie_embeddings:
        assert holder.model.output.weight is holder.model.tok_embeddings.weight
    block = sum(p.numel() * 4 for p in eager.layers["0"].parameters())
    embedding = eager.tok_embeddings.weight.numel() * 4
    model = sum(p.numel() * 4 for p in eager.parameters())
    assert len(held) == cfg.n_layers + 3 - cfg.tie_embeddings  # embedding, blocks, norm, output (unless tied)
    assert max(held) == max(block, embedding) < model / 2, (held, block, embedding, model)


def test_transformers_meta_init_equals_its_own_full_init_one_piece_at_a_time() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    holder, held = _streamed(
        lambda: transformers.LlamaForCausalLM(config), {f"model.model.layers.{i}" for i in range(3)}
    )
    torch.manual_seed(5)
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(config)
    reference.to_empty(device="cpu")
    reference.init_weights()  # what one rank holding the whole model does
    mine = {**dict(holder.model.named_parameters()), **dict(holder.model.named_buffers())}
    for name, tensor in [*reference.named_parameters(), *reference.named_buffers()]:
        assert torch.equal(mine[name], tensor), name  # rotary inv_freq (non-persistent) included
    assert max(held) < sum(p.numel() * 4 for p in reference.parameters()) / 2


class Rotary(nn.Module):
    """A non-persistent buffer computed in __init__ only: on meta it has no value, and no init sets it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


def test_buffer_no_init_sets_is_an_error() -> None:
    with torch.device("meta"):
        holder = Holder(Rotary)
    with pytest.raises(materialize.InitError, match=r"model\.inv_freq was built on the meta device"):
        materialize.materialize_streamed(
            holder, materialize.meta_twins(holder), materialize.meta_names(holder), torch.device("cpu"), set()
        )


def test_local_init_finds_the_same_unset_buffer() -> None:
    """weights_init="local" (each rank its own shards, in place): the same buffer is named, not trained on."""
    with torch.device("meta"):
        holder = Holder(Rotary)
    with pytest.raises(materialize.InitError, match=r"model\.inv_freq was built on the meta device"):
        materialize.init_in_place(holder, materialize.meta_names(holder), set(), torch.device("cpu"))


def test_local_init_runs_the_models_init_in_place_and_keeps_what_was_built_for_real() -> None:
    """In place, one process: the model's own init gives the meta-built tensors its distribution (norms ones,
    the rest N(0, 0.02) or the residual std), a submodule built for real keeps its values, and what a checkpoint
    or pretrained weights will fill (``skip``) is given storage only when nothing else needs the init."""
    cfg = LlamaConfig(vocab_size=512, dim=64, n_layers=3)
    with torch.device("meta"):
        holder = Holder(lambda: Llama(cfg))
    holder.probe = nn.Linear(4, 4)
    probe = holder.probe.weight.detach().clone()
    on_meta = materialize.meta_names(holder)
    assert materialize.init_in_place(holder, on_meta, set(), torch.device("cpu")) == 1
    assert torch.equal(holder.probe.weight, probe)
    for name, p in holder.model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            want = 0.02 / (2 * cfg.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
            assert abs(p.std().item() - want) < 5 * want / (2 * p.numel()) ** 0.5, name
    with torch.device("meta"):
        again = Holder(lambda: Llama(cfg))
    names = materialize.meta_names(again)
    assert materialize.init_in_place(again, names, names, torch.device("cpu")) == 0  # a checkpoint fills it all
    assert not any(t.is_meta for t in again.parameters())


def test_70b_plans_on_meta_under_dp8_x_tp8_without_allocating() -> None:
    code = (
        "from cuboid.planning.dryrun import dry_run; from cuboid.parallel.mesh import Layout; from cuboid.models import CausalLM;"
        "r = dry_run(CausalLM(model='70b', meta_init=True), Layout(dp_shard=8, tp=8));"
        "print(r.world, r.total_elements, r.elements, r.params)"
    )
    out = python([sys.executable, "-c", code], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    world, total, elements, params = map(int, out.stdout.split())
    from cuboid.models.llama import CONFIGS

    assert world == 64 and total == CONFIGS["70b"].num_params()
    assert total / 64 <= elements <= total / 64 * 1.001, (elements, total / 64)  # dim 0 splits nearly evenly
    assert params == elements * 4


def test_a_plan_that_does_not_divide_fails_in_the_dry_run() -> None:
    code = (
        "from cuboid.planning.dryrun import dry_run; from cuboid.parallel.mesh import Layout; from cuboid.models import CausalLM;"
        "dry_run(CausalLM(model='70b', meta_init=True), Layout(dp_shard=4, tp=16))"
    )
    out = python([sys.executable, "-c", code], timeout=300)
    assert out.returncode != 0 and "16" in out.stderr and "n_kv_heads" in out.stderr.replace("num_key_value", ""), (
        out.stderr[-2000:]
    )


@pytest.mark.slow
def test_stray_parameter_is_reported_and_kept_in_step(tmp_path) -> None:
    """A 0-d parameter on the LightningModule itself (a learned temperature), which FSDP2 cannot shard: it stays
    whole outside every FSDP unit, a warning names it and its size, and its gradient is averaged over dp, so dp2
    trains like one process (without the averaging each rank drifts). The rest of what the LightningModule holds
    itself is in its own unit (cuboid.parallel.units)."""
    import json

    from harness import WORKERS, torchrun
    from parity_lib import LOSS_RTOL, PARAM_ATOL

    spec = {"module": "stray_parameter", "strategy": {}}
    for world in (1, 2):
        torchrun(world, WORKERS / "parity_worker.py", str(tmp_path), json.dumps([{**spec, "name": f"stray-{world}"}]))
    one, two = (torch.load(tmp_path / f"stray-{w}.pt", weights_only=False) for w in (1, 2))
    for facts in two["ranks"]:
        assert facts["stray_warnings"] and "logit_scale (1 elements)" in facts["stray_warnings"][0]
    assert two["params"]["logit_scale"] != 1.0  # it trained
    rel = max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"], strict=True))
    err = max((two["params"][k] - v).abs().max().item() for k, v in one["params"].items())
    assert rel <= LOSS_RTOL and err <= PARAM_ATOL, (rel, err)
