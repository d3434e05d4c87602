"""The reference Llama: plain PyTorch, pipeline-ready, initialised the same eagerly and from meta."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import python
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cuboid.models import CONFIGS, TP_PLAN, TP_PLAN_NO_SP, Llama, LlamaConfig
from cuboid.parallel.materialize import init_module

CFG = LlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def test_forward_shapes_and_causality() -> None:
    torch.manual_seed(0)
    model = Llama(CFG)
    tokens = torch.randint(0, 128, (2, 10))
    logits = model(tokens)
    assert logits.shape == (2, 10, 128)
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 128
    # positions before the change see the same prefix, so their logits must not move
    assert torch.equal(model(changed)[:, :6], logits[:, :6])
    assert not torch.allclose(model(changed)[:, 6:], logits[:, 6:])


def test_pipeline_ready_pieces_can_be_missing() -> None:
    torch.manual_seed(0)
    model = Llama(CFG)
    tokens = torch.randint(0, 128, (2, 8))
    full = model(tokens)
    hidden = model.tok_embeddings(tokens)
    first = Llama(CFG)
    first.load_state_dict(model.state_dict())
    first.norm, first.output = None, None
    del first.layers["1"]
    last = Llama(CFG)
    last.load_state_dict(model.state_dict())
    last.tok_embeddings = None
    del last.layers["0"]
    torch.testing.assert_close(last(first(tokens)), full)
    assert first(tokens).shape == hidden.shape


def test_meta_init_then_init_weights_equals_eager_init() -> None:
    torch.manual_seed(3)
    eager = Llama(CFG)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = Llama(CFG)
    meta.to_empty(device="cpu")
    init_module(meta)
    for (name, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters(), strict=True):
        assert torch.equal(a, b), name


class _HostTensors(TorchDispatchMode):
    """Records every op that takes or makes a tensor off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.host_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta" for t in tree_flatten((args, kwargs, out))[0]):
            self.host_ops.append(str(func))
        return out


@pytest.mark.parametrize("positions", ["default", "given"])
def test_a_step_makes_no_tensor_on_the_host(positions: str) -> None:
    """The model on the meta device, standing in for a GPU: every tensor a forward and backward touches is on it. A
    tensor made on the host (``torch.arange(n)`` without ``device``, ``torch.tensor``) or copied to the device shows up
    as a CPU tensor (before: the rotary frequencies, made on the host and copied over in every attention layer: a
    host-to-device copy per layer and microbatch on a GPU)."""
    cfg = replace(CFG, rope_scaling=8.0, rope_original_max_seq_len=64)
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.zeros(2, 16, dtype=torch.long)
        position_ids = torch.zeros(2, 16, dtype=torch.long) if positions == "given" else None
    with _HostTensors() as mode:
        model(tokens, position_ids=position_ids).float().pow(2).mean().backward()
    assert mode.host_ops == []


@pytest.mark.parametrize(("name", "billions"), [("8b", 8.03), ("70b", 70.55)])
def test_named_sizes_match_the_model_cards(name: str, billions: float) -> None:
    with torch.device("meta"):
        model = Llama(name)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e9 - billions) < 0.01
    assert count == CONFIGS[name].num_params()


def test_tp_plan_names_real_modules() -> None:
    import fnmatch

    names = [n for n, _ in Llama(CFG).named_modules()]
    for pattern in [*TP_PLAN, *TP_PLAN_NO_SP]:
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern


def test_models_hold_no_parallel_code() -> None:
    for path in (Path(__file__).resolve().parents[2] / "models").glob("*.py"):
        imports = [line for line in path.read_text().splitlines() if line.lstrip().startswith(("import ", "from "))]
        assert not [line for line in imports if "distributed" in line], path


def test_model_size_configs_are_generated_from_the_code() -> None:
    """conf/model/*.yaml are written from cuboid.models.CONFIGS (one source of truth): they may not drift."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = python([sys.executable, str(root / "scripts" / "model_configs.py"), "--check"])
    assert proc.returncode == 0, proc.stderr


# Fields of Meta's published config.json files (meta-llama/Llama-3.2-1B; meta-llama/Llama-3.1-8B), as facts.
_LLAMA32_1B = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}  # fmt: skip
_LLAMA31_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "vocab_size": 128256,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}  # fmt: skip


@pytest.mark.parametrize(("name", "published"), [("1b", _LLAMA32_1B), ("8b", _LLAMA31_8B)])
def test_named_sizes_are_the_published_llama_3_configs(name: str, published: dict) -> None:
    from cuboid.models.llama import check_hf_config, hf_config

    assert check_hf_config(CONFIGS[name], published) == []
    ours = hf_config(CONFIGS[name])
    for key, value in published.items():
        assert ours[key] == value, (key, ours[key], value)
    other = {**published, "rope_scaling": {**published["rope_scaling"], "factor": 2.0}}
    assert check_hf_config(CONFIGS[name], other) == [
        f"rope scaling factor: 2.0 there, {CONFIGS[name].rope_scaling} here"
    ]


def test_flops_per_token_leaves_out_the_embedding_lookup() -> None:
    """6N counts the parameters used in matmuls: not the input embedding (a lookup), but a tied head's matrix."""
    from cuboid.models import CausalLM

    for name in ("150m", "1b", "8b"):
        cfg = CONFIGS[name]
        blocks = cfg.num_params() - cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) - cfg.dim
        assert cfg.matmul_params() == blocks + cfg.vocab_size * cfg.dim + cfg.dim
        lm = CausalLM(model=name)
        assert lm.flops_per_token(2048) == 6 * cfg.matmul_params() + 12 * cfg.n_layers * cfg.dim * 2048
    # 150m untied: counting the embedding too made 6N 19% larger
    cfg = CONFIGS["150m"]
    assert 1.15 < cfg.num_params() / cfg.matmul_params() < 1.2


def test_peak_flops_by_precision_and_exact_gpu_model() -> None:
    from cuboid.callbacks import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16-mixed") == 756e12
    assert peak_flops("NVIDIA H200", "bf16-true") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "32-true") == 67e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "32-true", tf32=True) == 494e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "16-mixed") == 312e12
    assert peak_flops("Tesla T4", "bf16-mixed") is None


@pytest.mark.parametrize("dims", [(16, 32), (10, 6)])
def test_reference_experts_grouped_equal_the_loop_and_read_nothing_to_the_host(dims, monkeypatch) -> None:
    """Cuboid's MoE runs its experts in one ``F.grouped_mm`` per projection where it runs (dimensions of 16-byte
    multiples here): outputs and gradients equal the per-expert loop's to the bit, and no value is read to the host
    (the loop reads the experts' row counts once per layer). Unaligned dimensions take the loop."""
    from cuboid.models import moe

    dim, hidden = dims
    torch.manual_seed(0)
    experts = moe.Experts(dim, hidden, 4)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    x = torch.randn(12, dim, requires_grad=True)
    index = torch.randint(0, 4, (12, 2))
    index[:, 1] = (index[:, 0] + 1) % 4
    weights, grad = torch.rand(12, 2), torch.randn(12, dim)
    reads, tolist = [0], torch.Tensor.tolist

    def counted(t: torch.Tensor) -> list:  # on CPU a read to the host never reaches the dispatcher: count the call
        reads[0] += 1
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    runs = {}
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(moe, "grouped_mm_runs", lambda *a: False)
        x.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
        reads[0] = 0
        out = experts(x, index, weights)
        out.backward(grad)
        runs[grouped] = (out, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad, reads[0])
    aligned = dim * 4 % 16 == 0 and hidden * 4 % 16 == 0
    assert runs[True][4] == (0 if aligned else 1) and runs[False][4] == 1
    for a, b in zip(runs[True][:4], runs[False][:4], strict=True):
        assert torch.equal(a, b)
