"""Plan resolution: a Hugging Face style plan is honoured, styles map to DTensor parallel styles."""

from __future__ import annotations

import lightning as L
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from cuboid.plans import find_model_plan, match_plan, to_parallel_style


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
    assert type(to_parallel_style("colwise")) is ColwiseParallel
    assert type(to_parallel_style("rowwise")) is RowwiseParallel
    output = to_parallel_style("output")
    assert isinstance(output, ColwiseParallel) and output.output_layouts == (Replicate(),)
    embedding = to_parallel_style("embedding")
    assert isinstance(embedding, RowwiseParallel) and embedding.input_layouts == (Replicate(),)
