"""Bad input fails before any work starts, with a message naming the sizes and the fix."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from cuboid import CuboidStrategy, Layout, LayoutError, PlanError
from cuboid.models import TP_PLAN, Llama, LlamaConfig
from cuboid.parallel.plans import check_tp_divisibility, find_blocks, find_model_plan, match_plan


class Wrapper(L.LightningModule):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        with torch.device("meta"):
            self.model = Llama(cfg)


def test_product_of_sizes_must_equal_world_size() -> None:
    with pytest.raises(LayoutError, match=r"tensor_parallel \(2\) = 6 processes, but the world size .* is 4"):
        Layout(dp_shard=3, tp=2).resolve(4)
    with pytest.raises(LayoutError, match=r"= 3 does not divide the world size 4"):
        Layout(tp=3).resolve(4)
    assert Layout(dp_replicate=2, tp=2).resolve(8).sizes == (1, 2, 2, 1, 2)  # (pp, dp_replicate, dp_shard, cp, tp)


def test_bad_layout_fails_in_the_launching_process_before_any_child_starts() -> None:
    with pytest.raises(LayoutError, match="tensor_parallel \\(3\\)"):
        L.Trainer(accelerator="cpu", devices=2, strategy=CuboidStrategy(tensor_parallel=3), logger=False)


def test_reshard_after_forward_int_must_divide_the_shard_group() -> None:
    with pytest.raises(
        LayoutError, match="reshard_after_forward=3 must be True, False or a divisor of data_parallel_shard=4"
    ):
        L.Trainer(accelerator="cpu", devices=4, strategy=CuboidStrategy(reshard_after_forward=3), logger=False)
    L.Trainer(accelerator="cpu", devices=4, strategy=CuboidStrategy(reshard_after_forward=2), logger=False)


def test_cpu_offload_on_cpu_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="with accelerator='cpu' they already are there. Set cpu_offload=False"):
        L.Trainer(accelerator="cpu", devices=2, strategy=CuboidStrategy(cpu_offload=True), logger=False)


def test_strategy_is_registered_by_name() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="cuboid", logger=False)
    assert isinstance(trainer.strategy, CuboidStrategy)


def test_pipeline_arguments_are_checked_up_front() -> None:
    from cuboid.pipeline.stages import PipelineError

    with pytest.raises(
        PipelineError,
        match=r"1F1B needs at least as many microbatches as pipeline stages: microbatches=2 < pipeline_parallel=4",
    ):
        CuboidStrategy(pipeline_parallel=4, microbatches=2)
    with pytest.raises(PipelineError, match="pipeline_schedule='Chimera' is unknown; choose one of GPipe, 1F1B"):
        CuboidStrategy(pipeline_parallel=2, pipeline_schedule="Chimera")
    with pytest.raises(PipelineError, match="use reshard_after_forward=False"):
        CuboidStrategy(pipeline_parallel=2, pipeline_schedule="ZBVZeroBubble", reshard_after_forward=True)
    CuboidStrategy(pipeline_parallel=2, pipeline_schedule="ZBVZeroBubble", activation_checkpointing="full")  # combine
    assert (
        CuboidStrategy(pipeline_parallel=2, pipeline_schedule="ZBVZeroBubble").settings.reshard_after_forward is False
    )
    assert CuboidStrategy(pipeline_parallel=2, pipeline_schedule="Interleaved1F1B").pipelining.microbatches == 8


def test_blocks_not_divisible_by_stages_need_an_explicit_split() -> None:
    from cuboid.pipeline.stages import PipelineError, stage_blocks

    with pytest.raises(
        PipelineError, match=r"6 blocks, not divisible by 4 pipeline stages. Pass pipeline_split=\[...\]"
    ):
        stage_blocks(6, 4, None)
    assert stage_blocks(6, 4, [2, 1, 2, 1]) == [[0, 1], [2], [3, 4], [5]]
    with pytest.raises(PipelineError, match="must have 4 non-negative numbers"):
        stage_blocks(6, 4, [3, 3])


def test_batch_not_divisible_by_microbatches_is_refused() -> None:
    from cuboid.pipeline.stages import PipelineError, split_batch

    with pytest.raises(PipelineError, match="batch size 6 is not divisible by microbatches=4"):
        split_batch({"tokens": torch.zeros(6, 3)}, 4)
    parts = split_batch({"tokens": torch.arange(8).view(8, 1), "tag": "x"}, 4)
    assert [p["tokens"].flatten().tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_model_that_is_not_pipeline_ready_says_what_is_missing() -> None:
    from cuboid.pipeline.stages import PipelineError, find_pipeline_split

    class ListModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = ListModel()

    lm = Module()
    with pytest.raises(PipelineError, match=r"model.layers is an nn.ModuleList; .* nn.ModuleDict keyed '0', '1'"):
        find_pipeline_split(lm, find_blocks(lm))
    with pytest.raises(PipelineError, match="no repeated blocks"):
        find_pipeline_split(lm, [])
    split = find_pipeline_split(Wrapper(LlamaConfig()), find_blocks(Wrapper(LlamaConfig())))
    assert (split.owner, split.container, split.pre, split.post) == (
        "model",
        "layers",
        ["tok_embeddings"],
        ["norm", "output"],
    )


def test_unknown_style_lists_the_valid_ones() -> None:
    with pytest.raises(PlanError, match=r"Unknown tensor-parallel style 'diagonal'.*'colwise', 'rowwise'"):
        CuboidStrategy(tensor_parallel=2, tensor_parallel_plan={"model.layers.*.attention.wq": "diagonal"})


def test_plan_pattern_that_matches_nothing_is_named() -> None:
    lm = Wrapper(LlamaConfig())
    with pytest.raises(
        PlanError, match=r"'layers\.\*\.attention\.wq' matches no module.*model\.layers\.0\.attention\.wq"
    ):
        match_plan(lm, {"layers.*.attention.wq": "colwise"})


def test_model_plan_is_found_and_prefixed() -> None:
    plan = find_model_plan(Wrapper(LlamaConfig()))
    assert plan == {f"model.{k}": v for k, v in TP_PLAN.items()}


def test_tp_not_dividing_kv_heads_names_the_module() -> None:
    lm = Wrapper(LlamaConfig(n_heads=8, n_kv_heads=2, dim=64))
    matched = match_plan(lm, find_model_plan(lm))
    with pytest.raises(PlanError, match=r"model\.layers\.0\.attention\.n_kv_heads = 2 is not divisible by tp=4"):
        check_tp_divisibility(lm, matched, 4)
    check_tp_divisibility(lm, matched, 2)  # fits


def test_tp_not_dividing_hidden_dims_names_the_module() -> None:
    lm = Wrapper(LlamaConfig(ffn_dim=130, vocab_size=256))
    matched = match_plan(lm, find_model_plan(lm))
    with pytest.raises(PlanError, match=r"model\.layers\.0\.feed_forward\.w1 \(Linear, colwise\): output features 130"):
        check_tp_divisibility(lm, matched, 4)


def test_blocks_are_found_automatically_and_by_name() -> None:
    lm = Wrapper(LlamaConfig(n_layers=3))
    assert [n for n, _ in find_blocks(lm)] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert len(find_blocks(lm, "model.layers")) == 3
    with pytest.raises(PlanError, match="block container 'model.blocks' is not a ModuleList"):
        find_blocks(lm, "model.blocks")
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"activation_checkpointing": "some"}, "activation_checkpointing='some'"),
        ({"data_parallel_shard": 0}, None),
    ],
)
def test_bad_arguments(kwargs: dict, match: str | None) -> None:
    if match:
        with pytest.raises(ValueError, match=match):
            CuboidStrategy(**kwargs)
    else:
        with pytest.raises(LayoutError, match="data_parallel_shard must be a positive integer"):
            CuboidStrategy(**kwargs).layout.resolve(2)


def test_unsupported_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="does not support precision='64-true'"):
        L.Trainer(accelerator="cpu", devices=2, strategy="cuboid", precision="64-true", logger=False)


def test_fsdp1_wrapped_modules_are_refused() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from cuboid.parallel.parallelize import check_no_fsdp1

    # FSDP1 cannot be constructed without an accelerator; an uninitialised instance is enough for the check.
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(fsdp1)
    root = nn.Sequential(nn.Linear(2, 2))
    root.add_module("wrapped", fsdp1)
    with pytest.raises(TypeError, match=r"FSDP1\): \['wrapped'\].*remove the FSDP wrapping"):
        check_no_fsdp1(root)
    check_no_fsdp1(nn.Sequential(nn.Linear(2, 2)))
