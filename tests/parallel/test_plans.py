"""Plan resolution: a Hugging Face style plan is honoured, styles map to DTensor parallel styles."""

from __future__ import annotations

import lightning as L
import pytest
from torch import nn
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel, SequenceParallel

from cuboid.parallel.plans import (
    PlanError,
    canonical_style,
    check_tp_divisibility,
    find_model_plan,
    match_plan,
    resolve_plan,
    to_parallel_style,
)
from cuboid.parallel.styles import LocalParams, MlaKvAProj


class HFStyleMLP(nn.Module):
    """Shaped like a Hugging Face base model: a ``config`` with ``base_model_tp_plan`` and ``layers``."""

    class Config:
        base_model_tp_plan = {
            "layers.*.up_proj": "colwise",
            "layers.*.down_proj": "rowwise",
            "embed_tokens": "embedding_rowwise",
        }

    def __init__(self) -> None:
        super().__init__()
        self.config = self.Config()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"up_proj": nn.Linear(8, 16), "down_proj": nn.Linear(16, 8)}) for _ in range(2)
        )


class CausalLM(nn.Module):
    _tp_plan = {"lm_head": "colwise_rep"}

    def __init__(self) -> None:
        super().__init__()
        self.model = HFStyleMLP()
        self.lm_head = nn.Linear(8, 16)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = CausalLM()


def test_hugging_face_plans_are_found_with_their_prefixes() -> None:
    plan = find_model_plan(Module())
    assert plan == {
        "net.lm_head": "colwise_rep",
        "net.model.layers.*.up_proj": "colwise",
        "net.model.layers.*.down_proj": "rowwise",
        "net.model.embed_tokens": "embedding_rowwise",
    }
    matched = match_plan(Module(), plan)
    assert {name: style for name, (_, style) in matched.items()} == {
        "net.lm_head": "output",
        "net.model.layers.0.up_proj": "colwise",
        "net.model.layers.1.up_proj": "colwise",
        "net.model.layers.0.down_proj": "rowwise",
        "net.model.layers.1.down_proj": "rowwise",
        "net.model.embed_tokens": "embedding",
    }


def test_styles_become_dtensor_parallel_styles() -> None:
    # torch's styles, which also take a layer stored transposed (transformers' Conv1D: GPT-2)
    assert type(to_parallel_style("colwise")).__mro__[1] is ColwiseParallel
    assert type(to_parallel_style("rowwise")).__mro__[1] is RowwiseParallel
    output = to_parallel_style("output")
    assert isinstance(output, ColwiseParallel) and output.output_layouts == (Replicate(),)
    embedding = to_parallel_style("embedding")
    assert isinstance(embedding, RowwiseParallel) and embedding.input_layouts == (Replicate(),)


def test_unit_styles_are_colwise_and_rowwise_with_whole_heads_and_refused_with_too_few_heads() -> None:
    """transformers' ``unit_colwise`` / ``unit_rowwise`` (MiniCPM5-MoE's k/v projections) keep whole heads on each
    rank: with a head count tp divides, that is colwise / rowwise; with fewer heads than tp (which transformers
    answers by replicating heads) the head check refuses the layout, naming the count."""
    from types import SimpleNamespace

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2)
            self.k_proj, self.o_proj = nn.Linear(64, 16), nn.Linear(64, 64)

    model = nn.Sequential()
    model.add_module("attn", Attention())
    matched = match_plan(model, {"attn.k_proj": "unit_colwise", "attn.o_proj": "unit_rowwise"})
    assert {name: style for name, (_, style) in matched.items()} == {"attn.k_proj": "colwise", "attn.o_proj": "rowwise"}
    check_tp_divisibility(model, matched, 2)
    with pytest.raises(PlanError, match=r"attn.config.num_key_value_heads = 2 is not divisible by tp=4"):
        check_tp_divisibility(model, matched, 4)


# --- Hugging Face's own style vocabulary, read from the installed transformers -----------------------------------


def _hf_registry() -> dict:
    tp = pytest.importorskip("transformers.distributed.tensor_parallel")
    pytest.importorskip("transformers.distributed.expert_parallel")  # registers the expert-parallel styles too
    return dict(tp.ALL_PARALLEL_STYLES.items())


def test_every_transformers_style_is_mapped_with_its_layouts_or_refused_by_name() -> None:
    """Each style transformers registers either maps onto a DTensor style with the same input/output layouts
    as transformers' own object, or is refused with a message naming the style and the module."""
    tp = pytest.importorskip("transformers.distributed.tensor_parallel")
    registry = _hf_registry()
    assert {"colwise_gather_output", "embedding_colwise", "rowwise_split_input", "replicate"} <= set(registry)
    mapped, refused = [], []
    for name, hf_style in registry.items():
        try:
            canonical = canonical_style(name, "model.layers.*.x")
            ours = to_parallel_style(canonical, rope_dim=8 if canonical == "mla_kv_a_proj" else None)
        except PlanError as err:
            assert repr(name) in str(err) and "'model.layers.*.x'" in str(err), err
            assert "experts" in str(err), err
            refused.append(name)
            continue
        mapped.append(name)
        if isinstance(hf_style, tp.ColwiseParallel):
            assert isinstance(ours, ColwiseParallel), name
            assert ours.input_layouts == (hf_style.input_layouts,), name
            assert ours.output_layouts == (hf_style.output_layouts,), name
        elif isinstance(hf_style, tp.RowwiseParallel):
            assert isinstance(ours, RowwiseParallel), name
            assert ours.input_layouts == (hf_style.input_layouts,), name
            assert ours.output_layouts == (hf_style.output_layouts,), name
        elif isinstance(hf_style, tp.EmbeddingParallel):
            # vocabulary-parallel (shard_dim 0) is torch's RowwiseParallel on an Embedding, hidden-dim is Colwise
            assert isinstance(ours, RowwiseParallel if hf_style.shard_dim == 0 else ColwiseParallel), name
            assert ours.input_layouts == (Replicate(),) and ours.output_layouts == (Replicate(),), name
        elif isinstance(hf_style, tp.SequenceParallel):
            assert isinstance(ours, SequenceParallel), name
        elif isinstance(hf_style, tp.ReplicatedWithGradAllReduce):
            assert isinstance(ours, LocalParams) and ours.replicate_plain and ours.grad_placements == [Partial()]
        elif isinstance(hf_style, tp.AllReduceParallel):
            assert isinstance(ours, PrepareModuleOutput), name
        elif name == "replicate":
            assert ours is None
        elif name == "local_params":
            assert isinstance(ours, LocalParams) and not ours.replicate_plain and ours.grad_placements is None
        elif isinstance(hf_style, getattr(tp, "MlaKvAProjParallel", ())):  # parity: tests/models/test_third_party.py
            assert isinstance(ours, MlaKvAProj) and ours.rope_dim == 8, name
        else:
            raise AssertionError(f"transformers style {name!r} ({type(hf_style).__name__}) is mapped but not checked")
    assert {"moe_tp_experts", "packed_colwise", "packed_rowwise"} <= set(refused)
    assert {"unit_colwise", "unit_rowwise"} & set(registry) <= set(mapped)  # transformers 5.25 added them
    assert len(mapped) >= 12, mapped


def test_rowwise_rep_means_a_replicated_input() -> None:
    """transformers registers rowwise_rep with a replicated input: it must not be treated as plain rowwise."""
    style = to_parallel_style("rowwise_rep")
    assert isinstance(style, RowwiseParallel) and style.input_layouts == (Replicate(),)


def test_a_hugging_face_llama_plan_resolves_without_a_user_plan() -> None:
    """transformers 5.x: LlamaForCausalLM carries {"lm_head": "colwise_gather_output"} and an embedding_rowwise
    embedding; tensor_parallel=2 with no plan stopped with 'Unknown tensor-parallel style'."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip

    class HFModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.LlamaForCausalLM(config)

    module = HFModule()
    matched = match_plan(module, find_model_plan(module))
    styles = {name: style for name, (_, style) in matched.items()}
    assert styles["model.lm_head"] == "output"
    assert styles["model.model.embed_tokens"] == "embedding"
    assert styles["model.model.layers.1.self_attn.o_proj"] == "rowwise"
    check_tp_divisibility(module, matched, 2)
    with pytest.raises(PlanError, match=r"num_key_value_heads = 2 is not divisible by tp=4"):
        check_tp_divisibility(module, matched, 4)


def test_a_models_own_plan_leaves_out_modules_its_config_does_not_build_and_a_users_plan_does_not() -> None:
    """transformers' Doge plans ``mlp.router_gate`` (built only with ``is_moe``): tensor_parallel=2 stopped with
    'matches no module' on a dense Doge, which transformers' own tensor parallel trains. A user's plan is taken as
    written."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DogeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    assert "layers.*.mlp.router_gate" in config.base_model_tp_plan and not config.is_moe

    class HFModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.AutoModelForCausalLM.from_config(config)

    module = HFModule()
    styles = {name: style for name, (_, style) in resolve_plan(module, None, 2).items()}
    assert styles["model.model.layers.1.self_attn.dt_proj"] == "rowwise"
    assert styles["model.model.layers.0.mlp.down_proj"] == "rowwise"
    assert not [name for name in styles if "router_gate" in name]
    with pytest.raises(PlanError, match=r"'model.model.layers.\*.mlp.router_gate' matches no module"):
        resolve_plan(module, {"model.model.layers.*.mlp.router_gate": "colwise"}, 2)


def test_expert_and_parameter_entries_are_refused_with_what_to_do() -> None:
    with pytest.raises(PlanError, match=r"'moe_tp_experts' on 'model.layers.\*.mlp.experts'.*Leave those modules out"):
        match_plan(Module(), {"model.layers.*.mlp.experts": "moe_tp_experts"})
    with pytest.raises(PlanError, match=r"names parameters \(\['net.lm_head.weight'\]\)"):
        match_plan(Module(), {"net.lm_head.weight": "colwise"})


def test_a_tied_embedding_and_head_stay_one_parameter_under_tp_or_the_plan_is_refused(tmp_path) -> None:
    """torch's parallelize_module gives each module it shards a parameter of its own, so a tied embedding and head
    (``tie_word_embeddings``) became two, each trained by half the gradient (the parity of transformers' tied Llama
    and Gemma 3 at tp2 drifted 2e-3 in 12 steps). Cuboid ties them again when both shard the weight alike, and
    refuses a plan that shards only one of them. On a one-rank gloo group (a one-rank mesh shards nothing, but
    parallelize_module still replaces the parameters)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from cuboid.parallel.parallelize import retie, tied_parameters

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = Tied()
        tied = tied_parameters(model)
        assert tied == [["embed.weight", "head.weight"]]
        parallelize_module(model, mesh, {"embed": RowwiseParallel(), "head": ColwiseParallel()})
        assert model.head.weight is not model.embed.weight  # what torch does: two parameters
        retie(model, tied)
        assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1
        model = Tied()
        tied = tied_parameters(model)
        parallelize_module(model, mesh, {"head": ColwiseParallel()})
        with pytest.raises(PlanError, match=r"embed.weight and head.weight are one parameter \(tied\).*embed.weight: "
                                            r"not sharded, head.weight: \[Shard\(dim=0\)\]"):  # fmt: skip
            retie(model, tied)
    finally:
        dist.destroy_process_group()


def test_mla_kv_a_proj_reads_the_rotary_width_from_its_attention_module_or_names_what_is_missing() -> None:
    """DeepSeek's plan gives its K/V down-projection ``mla_kv_a_proj``: the rotary key's width comes from the owning
    attention module (``qk_rope_head_dim``, or its config's); without one the plan is refused before any work."""
    from cuboid.parallel.plans import parallel_plan

    class Attention(nn.Module):
        def __init__(self, rope: int | None) -> None:
            super().__init__()
            self.kv_a_proj_with_mqa = nn.Linear(8, 12)
            if rope is not None:
                self.config = type("Config", (), {"qk_rope_head_dim": rope})()

    root = nn.Module()
    root.attn, root.other = Attention(4), Attention(None)
    style = parallel_plan({"attn.kv_a_proj_with_mqa": (root.attn.kv_a_proj_with_mqa, "mla_kv_a_proj")}, root)
    assert isinstance(style["attn.kv_a_proj_with_mqa"], MlaKvAProj) and style["attn.kv_a_proj_with_mqa"].rope_dim == 4
    with pytest.raises(PlanError, match=r"other.kv_a_proj_with_mqa: 'mla_kv_a_proj' splits .* Attention has none"):
        parallel_plan({"other.kv_a_proj_with_mqa": (root.other.kv_a_proj_with_mqa, "mla_kv_a_proj")}, root)
