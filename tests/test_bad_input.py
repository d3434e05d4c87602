"""The catalogue of wrong inputs: each fails before any work with a message that names what is wrong and the fix.

Every case is cheap (no process group); the guide's common-errors page (docs/errors.md) lists every case by its name (checked
below), so the table there and this one cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import AsyncCheckpointIO, LayerSync, TorchCheckpointIO, TorchSyncBatchNorm
from torch import nn

from cuboid import CuboidStrategy, ExpertParallelError, Layout, LayoutError, LoaderError, PlanError
from cuboid.checkpoint.checkpointer import Checkpointer
from cuboid.checkpoint.format import CheckpointError, check_loadable
from cuboid.context.attention import check_attention
from cuboid.context.hf import use_cp_attention
from cuboid.dropin import AveragingError, FreedWeightsError
from cuboid.experts import ExpertBias, expert_block
from cuboid.fabric import CuboidStrategy as FabricStrategy
from cuboid.fabric.checkpoints import split_state
from cuboid.fabric.optimizers import check_optimizer
from cuboid.models import CausalLM, Llama, LlamaConfig
from cuboid.packages.doors import check_door
from cuboid.parallel import sync_batchnorm
from cuboid.parallel.parallelize import moe_layers
from cuboid.parallel.plans import check_tp_divisibility, find_blocks, match_plan, resolve_plan
from cuboid.pipeline.composite import check_order, sent
from cuboid.pipeline.decoder_probe import DecoderSplitError
from cuboid.pipeline.stages import PipelineError, find_pipeline_split, split_batch, stage_blocks
from cuboid.replicas import FaultTolerance, ReplicaGroups
from cuboid.step import MuonError, refuse_muon_shapes

ROOT = Path(__file__).resolve().parents[1]
ERRORS_PAGE = ROOT / "docs" / "errors.md"  # the guide's common-errors page
FT = {"lighthouse": "http://127.0.0.1:9", "replica_group": 0, "groups": 2}  # nothing listens on port 9 (discard)


class _Wrapper(L.LightningModule):
    def __init__(self, cfg: LlamaConfig | None = None, plain: bool = False) -> None:
        super().__init__()
        if plain:
            self.model = nn.Sequential(nn.Linear(4, 4))
        else:
            with torch.device("meta"):
                self.model = Llama(cfg or LlamaConfig())


class _Composite(nn.Module):
    """Stands for a vision-language model's composite (its name is what the messages show)."""


class _MyLayerSync(LayerSync):
    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        return model


class _ListModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(8, 4)
        self.model.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def _trainer(**strategy: object) -> None:
    L.Trainer(accelerator="cpu", devices=2, strategy=CuboidStrategy(**strategy), logger=False)


def _damaged_checkpoint() -> None:
    """A checkpoint whose shard changed after its save wrote its checksum."""
    import tempfile

    from cuboid.checkpoint.sharded import verify_checkpoint, write_checksums

    with tempfile.TemporaryDirectory(prefix="cuboid-damaged-") as scratch:
        root = Path(scratch) / "step=5.ckpt"
        root.mkdir()
        (root / "__1_0.distcp").write_bytes(b"shard")
        write_checksums(root)
        (root / "__1_0.distcp").write_bytes(b"shart")
        verify_checkpoint(root)


def _slurm_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from cuboid.job.launch import check_slurm_tasks

    for key, value in {"SLURM_NTASKS": "6", "SLURM_JOB_NAME": "train", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    check_slurm_tasks(SLURMEnvironment(), num_nodes=2, devices=4)


def _torchrun_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started 2 processes on this node; the script says Trainer(devices=1)."""
    import lightning as L

    for key, value in {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
                       "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    L.Trainer(accelerator="cpu", devices=1, strategy=CuboidStrategy(), logger=False)


def _too_big_for_the_device() -> None:
    """What setup checks on a GPU before materializing anything: a 3.3 B-parameter fp32 Llama (built on meta) on 8
    ranks of a 2 GiB device."""
    from cuboid.measure import estimate, refuse_if_too_big
    from cuboid.pipeline.pipelining import Pipelining

    cfg = LlamaConfig(vocab_size=32000, dim=4096, n_layers=14, n_heads=32, n_kv_heads=8, ffn_dim=14336)
    lm = _Wrapper(cfg)
    layout = Layout(dp_shard="auto").resolve(8)
    est = estimate(lm, layout, resolve_plan(lm, None, 1), find_blocks(lm), Pipelining(Layout()))
    refuse_if_too_big(est, layout, 2 * 2**30, auto=True)


def _train_config(**overrides: object) -> None:

    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig

    from cuboid.train import check_config

    with initialize_config_module("cuboid.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"{k}={v}" for k, v in overrides.items()], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
    from omegaconf import open_dict

    with open_dict(cfg):
        del cfg["hydra"]  # (what @hydra.main hands the job: the hydra node only behind ${hydra:...})
    check_config(cfg)


# name -> (what to run, exception type, a regex the message must contain)


def _decoder_that_lengthens_its_sequence_in_forward() -> None:
    """A decoder whose base model's forward puts a learned token before the sequence, then runs its blocks on the
    longer sequence: a later stage, which receives hidden states between two blocks, cannot stand for that. (What
    keeps the shape, Granite's multiplier and GPT-2's positions, runs once on the first stage.)"""

    class Base(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(64, 8)
            self.prefix = torch.nn.Parameter(torch.zeros(1, 1, 8))
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, input_ids=None, inputs_embeds=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            hidden = torch.cat([self.prefix.expand(hidden.shape[0], -1, -1), hidden], dim=1)
            for layer in self.layers:
                hidden = layer(hidden)
            return (self.norm(hidden),)

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Base()
            self.lm_head = torch.nn.Linear(8, 64)

        def forward(self, input_ids=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
            return self.lm_head(self.model(input_ids=input_ids)[0])

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Decoder()

    lm = Module()
    find_pipeline_split(lm, find_blocks(lm))


def _muon_on_a_norm() -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4))
    try:
        torch.optim.Muon(model.parameters())
    except ValueError as error:
        raise refuse_muon_shapes(error, model.named_parameters()) from error


def _load_balancing_loss_under_pipeline_parallel() -> None:
    """transformers' Qwen3-MoE with output_router_logits=True (its loss adds the load-balancing loss), cut for pp2,
    with its weight under another name than transformers' router_aux_loss_coef (as a family of its own might)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
    )  # fmt: skip

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.model = transformers.AutoModelForCausalLM.from_config(config)
            self.model.balance_weight = self.model.router_aux_loss_coef
            del self.model.router_aux_loss_coef

    lm = Module()
    find_pipeline_split(lm, find_blocks(lm))


def _cuboid_moe_under_pipeline_parallel() -> None:
    """A model of Cuboid's contract with a load-balancing loss whose model has no aux_loss() to send along."""
    lm = CausalLM(model="moe_debug")
    lm.configure_model()
    lm.model.aux_loss = None
    find_pipeline_split(lm, find_blocks(lm))


def _pipelined_step_calling_the_model_twice() -> None:
    from cuboid.pipeline.runner import _StageOutput

    standin = _StageOutput(nn.Linear(2, 2), torch.zeros(1), "training_step", "model", None)
    standin(torch.zeros(1))
    standin(torch.zeros(1))


def _keyword_tensor_without_the_batch_dimension() -> None:
    import transformers

    from cuboid.pipeline.decoder_call import bind_call

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.zeros(4, 8, dtype=torch.long)
    bind_call(model, (), {"input_ids": ids, "position_ids": torch.arange(8)}, "training_step", "model")


def _cp_step(model: torch.nn.Module, *args: object, **kwargs: object) -> None:
    """Call ``model`` as a context-parallel step at cp=2 would (rank 0 of 2; no process group is reached before the
    refusal)."""
    from cuboid.context import ContextParallel
    from cuboid.context.hf import use_cp_attention

    cp = ContextParallel(Layout(cp=2))
    cp._transformers = use_cp_attention(model)
    cp.positions_keyword = "position_ids"
    model.register_forward_pre_hook(cp._shard_inputs, with_kwargs=True)
    with cp.step():
        model(*args, **kwargs)


def _cp_attention_call(**extra: object) -> None:
    """Call the "cuboid_cp" attention function as a transformers layer would, with ``extra`` keywords, in a
    context-parallel step at cp=2 (no process group is reached before the refusal)."""
    from cuboid.context import ContextParallel
    from cuboid.context.hf import _attention

    q = torch.zeros(1, 2, 4, 8)
    with ContextParallel(Layout(cp=2)).step():
        _attention(torch.nn.Identity(), q, q, q, None, **extra)


def _tiny_hf(family: str = "llama", **extra: object) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model(
        family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **extra
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _doge_under_cp() -> None:
    """A transformers Doge (a dynamic mask computed from its values) switched to Cuboid's context-parallel attention,
    run in a context-parallel step at cp=2: its first layer refuses before any collective."""
    from cuboid.context import ContextParallel

    model = _tiny_hf("doge", num_key_value_heads=2)
    use_cp_attention(model)
    with ContextParallel(Layout(cp=2)).step():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


def _no_position_ids() -> None:
    from cuboid.context import positions_keyword

    positions_keyword(torch.nn.Embedding(4, 4))


CASES: dict[str, tuple[Callable[..., object], type[BaseException], str]] = {
    "sizes that do not multiply to the world size": (
        lambda: Layout(dp_shard=3, tp=2).resolve(4),
        LayoutError,
        r"= 6 processes, but the world size .* is 4",
    ),
    "a size that does not divide the world size": (
        lambda: Layout(tp=3).resolve(4),
        LayoutError,
        r"= 3 does not divide the world size 4",
    ),
    "a layout the Trainer's devices cannot hold (before any process starts)": (
        lambda: _trainer(tensor_parallel=3),
        LayoutError,
        r"tensor_parallel \(3\)",
    ),
    "a non-positive size": (
        lambda: CuboidStrategy(data_parallel_shard=0).layout.resolve(2),
        LayoutError,
        "must be a positive integer",
    ),
    "reshard_after_forward that does not divide the shard group": (
        lambda: L.Trainer(accelerator="cpu", devices=4, strategy=CuboidStrategy(reshard_after_forward=3), logger=False),
        LayoutError,
        "must be True, False or a divisor",
    ),  # fmt: skip
    "an unknown activation_checkpointing mode": (
        lambda: CuboidStrategy(activation_checkpointing="some"),
        ValueError,
        "activation_checkpointing='some'",
    ),
    "cpu_offload on a CPU": (lambda: _trainer(cpu_offload=True), ValueError, "Set cpu_offload=False"),
    "an unsupported precision": (
        lambda: L.Trainer(accelerator="cpu", devices=2, strategy="cuboid", precision="64-true", logger=False),
        ValueError,
        "does not support precision='64-true'",
    ),  # fmt: skip
    "an unknown checkpoint_format": (
        lambda: Checkpointer("zip"),
        ValueError,
        "checkpoint_format='zip'; choose 'sharded'",
    ),
    "an unknown data_position": (
        lambda: CuboidStrategy(data_position="step"),
        ValueError,
        "data_position='step'; choose 'exact'",
    ),
    "fault_tolerance with an unknown key": (
        lambda: CuboidStrategy(fault_tolerance={**FT, "group": 1}),
        ValueError,
        r"fault_tolerance has unknown keys \['group'\]",
    ),
    "a replica group outside the groups": (
        lambda: CuboidStrategy(fault_tolerance={**FT, "replica_group": 2}),
        ValueError,
        "replica_group=2 with groups=2",
    ),
    "fault_tolerance with data_parallel_replicate": (
        lambda: CuboidStrategy(data_parallel_replicate=2, fault_tolerance=FT),
        ValueError,
        "set data_parallel_replicate=1 in each job",
    ),
    "a lighthouse that cannot be reached": (
        lambda: ReplicaGroups(FaultTolerance(**FT)).probe(),
        ConnectionError,
        "the lighthouse at http://127.0.0.1:9 cannot be reached",
    ),
    "an unknown preemption signal": (
        lambda: CuboidStrategy(preempt_on=("SIGFOO",)),
        ValueError,
        "'SIGFOO' is not a signal",
    ),
    "a negative flight recorder size": (
        lambda: CuboidStrategy(flight_recorder=-1),
        ValueError,
        "flight_recorder=-1: a number of entries >= 0",
    ),
    "an unknown nonfinite mode": (
        lambda: CuboidStrategy(nonfinite="sometimes"),
        ValueError,
        "nonfinite='sometimes'; choose None",
    ),
    "an unknown defer_reductions mode": (
        lambda: CuboidStrategy(defer_reductions="sometimes"),
        ValueError,
        "defer_reductions='sometimes': choose 'replicas'",
    ),
    "an unknown pipeline schedule": (
        lambda: CuboidStrategy(pipeline_parallel=2, pipeline_schedule="Chimera"),
        PipelineError,
        "unknown; choose one of GPipe",
    ),  # fmt: skip
    "fewer microbatches than pipeline stages": (
        lambda: CuboidStrategy(pipeline_parallel=4, microbatches=2),
        PipelineError,
        "Use microbatches>=4",
    ),
    "virtual stages with a one-stage-per-rank schedule": (
        lambda: CuboidStrategy(pipeline_parallel=2, virtual_stages=2),
        PipelineError,
        "needs an interleaved",
    ),
    "a zero-bubble schedule with resharding after forward": (
        lambda: CuboidStrategy(pipeline_parallel=2, pipeline_schedule="ZBVZeroBubble", reshard_after_forward=True),
        PipelineError,
        "use reshard_after_forward=False",
    ),  # fmt: skip
    "blocks that do not split evenly into stages": (
        lambda: stage_blocks(6, 4, None),
        PipelineError,
        r"Pass pipeline_split=\[\.\.\.\]",
    ),
    "a pipeline_split of the wrong length": (
        lambda: stage_blocks(6, 4, [3, 3]),
        PipelineError,
        "must have 4 non-negative numbers",
    ),
    "a batch the microbatches cannot split": (
        lambda: split_batch({"tokens": torch.zeros(6, 3)}, 4),
        PipelineError,
        "not divisible by microbatches=4",
    ),
    "a model that is not pipeline-ready": (
        lambda: find_pipeline_split(_ListModel(), find_blocks(_ListModel())),
        PipelineError,
        "nn.ModuleDict keyed '0', '1'",
    ),  # fmt: skip
    "a decoder whose forward lengthens its sequence before its blocks, under pp": (
        _decoder_that_lengthens_its_sequence_in_forward,
        PipelineError,
        r"Base.forward hands its first block hidden states of shape \(1, 5, 8\) from inputs_embeds of shape "
        r"\(1, 4, 8\)",
    ),
    "a pipelined step that calls the model twice": (
        _pipelined_step_calling_the_model_twice,
        PipelineError,
        r"calls self.model\(...\) 2 times in one step",
    ),
    "a keyword tensor without the batch dimension, under pp": (
        _keyword_tensor_without_the_batch_dimension,
        ValueError,
        r"passes position_ids of shape \(8,\) to self.model\(...\), which cannot be split into microbatches",
    ),
    "an unknown tensor-parallel style": (
        lambda: match_plan(_Wrapper(), {"model.layers.*.attention.wq": "diagonal"}),
        PlanError,
        "Unknown tensor-parallel style 'diagonal'",
    ),  # fmt: skip
    "a mixture-of-experts style": (
        lambda: match_plan(_Wrapper(), {"model.layers.*.feed_forward": "moe_tp_experts"}),
        PlanError,
        "Cuboid does not support",
    ),  # fmt: skip
    "a plan pattern that matches no module": (
        lambda: match_plan(_Wrapper(), {"model.blocks.*.q": "colwise"}),
        PlanError,
        "matches no module",
    ),
    "tensor_parallel that does not divide the heads": (
        lambda: check_tp_divisibility(
            _Wrapper(LlamaConfig(n_heads=4, n_kv_heads=2)),
            match_plan(_Wrapper(), {"model.layers.*.attention.wk": "colwise"}),
            4,
        ),
        PlanError,
        "tensor_parallel=4",
    ),  # fmt: skip
    "tensor_parallel > 1 on a model with no plan": (
        lambda: resolve_plan(_Wrapper(plain=True), None, 2),
        PlanError,
        "carries no tensor-parallel plan",
    ),
    "resuming from a save that never finished": (
        lambda: check_loadable(Path("/tmp/.step=5.ckpt.tmp")),
        CheckpointError,
        "never finished",
    ),
    "a checkpoint path that does not exist": (
        lambda: check_loadable(Path("/nonexistent/step=5.ckpt")),
        CheckpointError,
        "does not exist",
    ),
    "a checkpoint damaged on disk": (_damaged_checkpoint, CheckpointError, r"__1_0.distcp: xxHash3 .*, the save wrote"),
    "a SLURM task count that disagrees with nodes x devices": (
        _slurm_mismatch,
        LayoutError,
        r"SLURM runs 6 tasks .* num_nodes \(2\) x devices \(4\) = 8",
    ),
    "torchrun processes that disagree with the Trainer's devices": (
        _torchrun_mismatch,
        LayoutError,
        r"The launcher started 2 processes \(this one local rank 1\), but the Trainer expects num_nodes \(1\) x "
        r"devices \(1\) = 1",
    ),
    "a layout whose parameters and gradients exceed the GPU": (
        _too_big_for_the_device,
        LayoutError,
        r"The layout pp=1 x dp_replicate=1 x dp_shard=8 x tp=1 cannot fit: each rank would hold 1\.54 GiB of "
        r"parameter shards .* the device has 2\.00 GiB\. data_parallel_shard='auto' filled 8 .* Parameters and gradients "
        r"alone need data_parallel_shard >= 13 \(13 GPUs",
    ),
    "a Hydra sequence longer than the model's": (
        lambda: _train_config(**{"data.seq_len": 4096}),
        ValueError,
        "is longer than model.max_seq_len",
    ),
    "an unknown mode of the main job": (lambda: _train_config(mode="train"), ValueError, "mode='train': choose 'fit'"),
    "a context_parallel that is not a positive integer": (
        lambda: CuboidStrategy(context_parallel=0).layout.resolve(2),
        LayoutError,
        "context_parallel must be a positive integer",
    ),
    "a sequence length context parallel cannot split": (
        lambda: _cp_step(_tiny_hf(), input_ids=torch.zeros(2, 10, dtype=torch.long)),
        ValueError,
        r"a sequence of 10 tokens cannot be split over context_parallel=2: it needs a multiple of 2 x cp = 4",
    ),
    "a batch without a sequence dimension under context parallel": (
        lambda: _cp_step(_tiny_hf(), input_ids=torch.zeros(8, dtype=torch.long)),
        ValueError,
        r"the model's first input is a tensor of shape \(8,\): a batch without a sequence dimension",
    ),
    "an attention implementation context parallel cannot split": (
        lambda: _cp_step(_tiny_hf(attn_implementation="flex_attention"), input_ids=torch.zeros(2, 8, dtype=torch.long)),
        ValueError,
        r"cannot split attn_implementation='flex_attention' of LlamaForCausalLM.*attn_implementation='sdpa'",
    ),
    "a relative position bias under context parallel": (
        lambda: _cp_attention_call(position_bias=torch.zeros(1, 2, 4, 4)),
        ValueError,
        r"Identity \(layer \?\) passes position_bias to its attention function.*Use context_parallel=1",
    ),
    "a layer's own attention mask under context parallel": (
        _doge_under_cp,
        ValueError,
        r"DogeAttention \(layer 0\) passes its attention function a mask of its own making \(shape \(1, 2, 8, 8\).*"
        r"Use context_parallel=1",
    ),
    "layers that mix tokens outside attention under context parallel": (
        lambda: use_cp_attention(_tiny_hf("minimax", num_key_value_heads=2)),
        ValueError,
        r"context_parallel cannot split MiniMaxForCausalLM: config.layer_types has 'linear_attention' \(layers 1\).*"
        r"Use context_parallel=1",
    ),
    "context parallel with compiled, checkpointed blocks": (
        lambda: CuboidStrategy(context_parallel=2, compile=True, activation_checkpointing="full"),
        ValueError,
        r"context_parallel=2 with compile=True and activation_checkpointing='full' is not supported yet",
    ),
    "a model that takes no position_ids under context parallel": (
        _no_position_ids,
        ValueError,
        r"context_parallel needs the model's forward to take position_ids.*Embedding.forward",
    ),
    "attention dropout under context parallel": (
        lambda: check_attention(_tiny_hf(attention_dropout=0.1), 2),
        ValueError,
        r"context_parallel=2 cannot split LlamaForCausalLM: its attention_dropout=0.1 has no block kernel.*"
        r"Set config.attention_dropout=0.0",
    ),
    "a head dim no GPU attention kernel takes under context parallel": (
        lambda: check_attention(_tiny_hf(head_dim=12), 2),
        ValueError,
        r"its head dim 12 is not a multiple of 8, which FlashAttention and the memory-efficient kernel need",
    ),
}


def _lora_under_tp(**lora: object) -> None:
    """A LoRA fine-tune of a tiny transformers Llama, its plan resolved at tp2 (no process group needed)."""
    from peft import LoraConfig, get_peft_model

    holder = nn.Module()
    holder.model = get_peft_model(_tiny_hf(), LoraConfig(r=2, **lora))
    resolve_plan(holder, None, 2)


def _lora_init_that_reads_the_base_on_meta() -> None:
    from peft import LoraConfig, get_peft_model

    from cuboid.adapters import init_adapters

    model = get_peft_model(_tiny_hf(), LoraConfig(r=2, target_modules=["q_proj"]))
    model.peft_config["default"].init_lora_weights = "pissa"  # as built with it: PiSSA reads the base's SVD
    init_adapters(model)


def _moe_blocks(family: str, **config: object) -> list[tuple[str, nn.Module]]:
    """The decoder layers of a tiny transformers model built on meta, as Cuboid's block search returns them."""
    import transformers

    kinds = {"qwen3_moe": transformers.Qwen3MoeConfig, "llama": transformers.LlamaConfig}
    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, **config}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(kinds[family](vocab_size=32, **small))
    return find_blocks(model, None)


def _experts_as_modules() -> list[nn.Module]:
    """A mixture-of-experts layer that keeps each expert as its own module (an older layout)."""
    block = nn.Module()
    block.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    return moe_layers([("model.layers.0", block)], 2)


class _MyCheckpointIO(TorchCheckpointIO):
    pass


class _ManualModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _pickle_kept_sharded() -> None:
    """A model ``fully_shard`` sharded (here over one rank) that the run's end keeps sharded, then pickled."""
    import pickle

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cuboid.dropin.after_run import refuse_pickling

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
        refuse_pickling(model, "pipeline_parallel=2 split it otherwise than over the data-parallel ranks")
        pickle.dumps(model)
    finally:
        if started:
            dist.destroy_process_group()


def _library_sampler_over_the_world() -> None:
    """A library's own ``DistributedSampler`` made for DDP over the world's 4 ranks, under a layout of tp2 x dp2."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from cuboid.dropin.loaders import check_sampler_ranks

    data = TensorDataset(torch.zeros(8, 2))
    loader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=4, rank=3))
    check_sampler_ranks(loader, 2, 1, False, "pp=1 x dp_replicate=1 x dp_shard=2 x tp=2")


def _forward_that_differentiates_its_sharded_layers() -> None:
    """A force field's step on a model ``fully_shard`` sharded (over one rank): forces from its energy with
    ``torch.autograd.grad(create_graph=True)`` in the forward, then the step's backward, as the strategy runs it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cuboid.dropin import explain_freed_weights

    class Potential(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.layer, self.out = nn.Linear(3, 8), nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, pos: torch.Tensor) -> torch.Tensor:
            pos = pos.requires_grad_(True)
            energy = self.out(torch.tanh(self.layer(torch.tanh(self.inp(pos))))).sum()
            return -torch.autograd.grad(energy, pos, create_graph=True)[0]  # the forces

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, mesh = Potential(), init_device_mesh("cpu", (1,))
        fully_shard(model.layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with explain_freed_weights(model):
            model(torch.randn(4, 3)).square().sum().backward()
    finally:
        if started:
            dist.destroy_process_group()


def _averaging(callback: str, split: str | None, sharded_files: bool) -> None:
    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

    from cuboid.dropin import check_averaging

    made = {"ema": lambda: EMAWeightAveraging(decay=0.9), "swa": lambda: StochasticWeightAveraging(swa_lrs=0.01)}
    check_averaging([made[callback]()], split, sharded_files)


CASES.update(
    {
        "a forward that differentiates its sharded layers itself": (
            _forward_that_differentiates_its_sharded_layers,
            FreedWeightsError,
            r"The backward reached weights FSDP2 had already freed: the model's forward differentiates through its "
            r"sharded layers itself \(torch.autograd.grad\(\.\.\., create_graph=True\).* leave data_parallel_shard unset",
        ),
        "weight averaging under tensor parallel": (
            lambda: _averaging("swa", "tensor_parallel=2 split it", False),
            AveragingError,
            r"StochasticWeightAveraging\(\.\.\.\)\]\) keeps a whole copy of the model .* this layout's "
            r"tensor_parallel=2 split it: .* Average under data parallel only",
        ),
        "EMAWeightAveraging with the sharded format": (
            lambda: _averaging("ema", None, True),
            AveragingError,
            r"EMAWeightAveraging\(\.\.\.\)\]\) writes its average into each checkpoint's state_dict .* "
            r"Set CuboidStrategy\(checkpoint_format='full'\)",
        ),
        "a library's DistributedSampler over the world's ranks under tensor parallel": (
            _library_sampler_over_the_world,
            LoaderError,
            r"DistributedSampler deals its samples over 4 replicas \(this process as replica 3\), but Cuboid's layout "
            r"pp=1 x dp_replicate=1 x dp_shard=2 x tp=2 has 2 data-parallel ranks .* "
            r"`\*\*trainer.strategy.distributed_sampler_kwargs` \(num_replicas=2, rank=1\)",
        ),
        "an expert_parallel that does not divide the data-parallel shard": (
            lambda: CuboidStrategy(expert_parallel=3).layout.resolve(4),
            LayoutError,
            r"expert_parallel=3 must divide data_parallel_shard \(4\) x context_parallel \(1\) = 4",
        ),
        "a load-balancing loss without router_aux_loss_coef under pipeline parallel": (
            _load_balancing_loss_under_pipeline_parallel,
            PipelineError,
            r"adds a load-balancing loss \(config.output_router_logits=True\) but has no router_aux_loss_coef.*"
            r"output_router_logits=False",
        ),
        "a load-balancing loss without aux_loss() under pipeline parallel": (
            _cuboid_moe_under_pipeline_parallel,
            PipelineError,
            r"adds a load-balancing loss \(cfg.aux_loss_coef=0.01\) but has no aux_loss\(\) method.* aux_loss_coef=0",
        ),
        "an unknown load_balancing": (
            lambda: CuboidStrategy(load_balancing="sometimes"),
            ValueError,
            r"load_balancing='sometimes'; choose 'global' .* or 'local'",
        ),
        "an expert_bias_rate that is not a positive number": (
            lambda: CuboidStrategy(expert_bias_rate=0),
            ValueError,
            r"expert_bias_rate=0: give the step by which each expert's bias moves .* or leave it unset",
        ),
        "the experts' bias on a dense model": (
            lambda: ExpertBias(1e-3).check(Llama(LlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2))),
            ValueError,
            r"expert_bias_rate=0.001 but Llama has no mixture-of-experts block Cuboid recognises.* dense model",
        ),
        "Muon handed a parameter that is not a matrix": (
            _muon_on_a_norm,
            MuonError,
            r"Muon steps matrices only, and configure_optimizers handed it 1.weight, 1.bias .* to AdamW",
        ),
        "an expert_parallel that does not divide the experts": (
            lambda: expert_block(6, 4, 0),
            ExpertParallelError,
            r"expert_parallel=4 does not divide the 6 experts of each MoE layer.* divides 6",
        ),
        "expert parallel on a dense model": (
            lambda: moe_layers(_moe_blocks("llama"), 2),
            ExpertParallelError,
            r"expert_parallel=2 but no block holds a mixture-of-experts layer.*leave expert_parallel=1",
        ),
        "a mixture-of-experts layer whose experts are separate modules": (
            _experts_as_modules,
            ExpertParallelError,
            r"model.layers.0.experts \(ModuleList of 4 Linear\) holds its experts as separate modules",
        ),
        "pipeline parallel under Fabric": (
            lambda: FabricStrategy(pipeline_parallel=2),
            PipelineError,
            r"pipeline_parallel=2 under Fabric: .* no training_step .* L.Trainer\(strategy=cuboid.CuboidStrategy",
        ),
        "an optimizer made before fabric.setup sharded the model": (
            lambda: check_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), nn.Linear(2, 2)),
            RuntimeError,
            r"holds 2 parameter\(s\) that are not the set-up model's: .* Create it after setup, or pass it",
        ),
        "LoRA on an embedding under tensor parallel": (
            lambda: _lora_under_tp(target_modules=["q_proj", "embed_tokens"]),
            PlanError,
            r"cannot split the LoRA layer 'model.base_model.model.model.embed_tokens': .* Leave it out of LoraConfig",
        ),
        "DoRA under tensor parallel": (
            lambda: _lora_under_tp(target_modules=["q_proj"], use_dora=True),
            PlanError,
            r"q_proj': it uses DoRA, whose magnitude needs the norms of the whole",
        ),
        "a LoRA init that reads the base weights, on meta": (
            _lora_init_that_reads_the_base_on_meta,
            ValueError,
            r"init_lora_weights='pissa', which reads the base weights .* Build the model for real",
        ),
        "sync_batchnorm under context parallel": (
            lambda: sync_batchnorm(TorchSyncBatchNorm(), Layout(cp=2), nn.Module(), None),
            LayoutError,
            r"sync_batchnorm=True\) with context_parallel=2: .* Set context_parallel=1, or drop sync_batchnorm",
        ),
        "a LayerSync plugin other than sync_batchnorm": (
            lambda: sync_batchnorm(_MyLayerSync(), Layout(), nn.Module(), None),
            TypeError,
            r"plugins=\[_MyLayerSync\(\)\]\): CuboidStrategy honours only Trainer\(sync_batchnorm=True\)",
        ),
        "a CheckpointIO plugin": (
            lambda: Checkpointer().use_checkpoint_io(AsyncCheckpointIO()),
            TypeError,
            r"plugins=\[AsyncCheckpointIO\(...\)\]\): .* cannot use a CheckpointIO plugin for it. For saves in the "
            r"background, set CuboidStrategy\(async_checkpoint=True\)",
        ),
        "a CheckpointIO plugin with the sharded format": (
            lambda: Checkpointer("sharded").use_checkpoint_io(_MyCheckpointIO()),
            TypeError,
            r"plugins=\[_MyCheckpointIO\(...\)\]\): a CheckpointIO plugin writes each checkpoint as one file, and "
            r"CuboidStrategy\(checkpoint_format='sharded'\) writes a directory .* Set "
            r"CuboidStrategy\(checkpoint_format='full'\)",
        ),
        "an unknown broadcast_buffers mode": (
            lambda: _trainer(broadcast_buffers="some"),
            ValueError,
            r"broadcast_buffers='some': choose True \(changed buffers\), 'all' or False",
        ),
        "an unknown weights_init": (
            lambda: CuboidStrategy(weights_init="zeros"),
            ValueError,
            r"weights_init='zeros': choose 'auto', 'rank0' or 'local'",
        ),
        "weights_init local with cpu_offload": (
            lambda: FabricStrategy(weights_init="local", cpu_offload=True),
            ValueError,
            r"weights_init='local' with cpu_offload=True: .* Use weights_init='rank0'",
        ),
        "manual optimization under pipeline parallel": (
            lambda: CuboidStrategy(pipeline_parallel=2).pipelining.check_module(_ManualModule()),
            PipelineError,
            r"_ManualModule optimizes by hand \(automatic_optimization=False\), and under pipeline_parallel=2 .* Use "
            r"pipeline_parallel=1",
        ),
        "a CuboidStrategy of the other Lightning package": (
            lambda: check_door("pytorch_lightning", "pytorch_lightning.Trainer", CuboidStrategy()),
            TypeError,
            r"pytorch_lightning.Trainer\(strategy=cuboid.CuboidStrategy\(...\)\): that CuboidStrategy is built for "
            r"`lightning.pytorch`.* Pass cuboid.pytorch_lightning.CuboidStrategy\(...\) instead .* "
            r"or strategy=\"cuboid\"",
        ),
        "pickling a model kept sharded after the run": (
            _pickle_kept_sharded,
            TypeError,
            r"FSDPLinear cannot be pickled: CuboidStrategy keeps it sharded after the run \(pipeline_parallel=2 split "
            r"it .*\), each rank holding only its slices\. Save it with trainer.save_checkpoint\(path\) and read the "
            r"whole weights with "
            r"cuboid.read_model_weights\(path\)",
        ),
        "a cross-attention composite's step without images under pipeline parallel": (
            lambda: sent({"cross_attention_states": None}, ["cross_attention_states"], _Composite()),
            DecoderSplitError,
            r"_Composite handed its language model no \['cross_attention_states'\] in this step \(a batch without "
            r"images\?\); under pipeline_parallel every step's later stages read them",
        ),
        "a composite whose parts run after its language model under pipeline parallel": (
            lambda: check_order(_Composite(), ["vision_model", "", "pooler"]),
            DecoderSplitError,
            r"_Composite runs \['pooler'\] after its language model; Cuboid runs a composite model's other parts on "
            r"the first stage",
        ),
        "a Fabric checkpoint of two models": (
            lambda: split_state({"model": nn.Linear(2, 2), "teacher": nn.Linear(2, 2)}, nn.Linear(2, 2)),
            CheckpointError,
            r"the one model set up with fabric.setup .* holds modules: 'model', 'teacher'",
        ),
    }
)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_with_a_message_that_says_what_to_do(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run, error, match = CASES[name]
    with pytest.raises(error, match=match):
        run(monkeypatch) if run in (_slurm_mismatch, _torchrun_mismatch) else run()


def test_the_catalogue_is_large_and_in_the_guide() -> None:
    assert len(CASES) >= 25
    section = ERRORS_PAGE.read_text()
    missing = [name for name in CASES if re.sub(r"\s+", " ", name) not in re.sub(r"\s+", " ", section)]
    assert not missing, missing


def test_every_strategy_argument_has_a_hydra_twin() -> None:
    """conf/strategy/fsdp.yaml (which the other presets extend) names every CuboidStrategy argument."""
    import inspect

    import yaml

    conf = yaml.safe_load((ROOT / "conf" / "strategy" / "fsdp.yaml").read_text())
    internal = {"self", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    names = set(inspect.signature(CuboidStrategy.__init__).parameters) - internal
    assert not names - set(conf), sorted(names - set(conf))
