"""Lightning's positional optimizer state <-> Cuboid's names (cuboid.checkpoint.lightning), in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cuboid.checkpoint.lightning import FormatError, from_positional, optimizer_groups, to_positional


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two param groups (decay / no decay), built the way users build them, and one step of state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}])
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_positions_follow_the_optimizer_groups_both_ways() -> None:
    model, opt = _model_and_optimizer()
    groups = optimizer_groups(model, [opt])[0]
    assert groups == [["0.weight", "2.weight"], ["0.bias", "1.weight", "1.bias", "2.bias"]]
    saved = opt.state_dict()  # what plain Lightning writes under optimizer_states
    flat = from_positional(saved, groups, "ckpt")
    assert torch.equal(flat["state.2.weight.exp_avg"], opt.state[model[2].weight]["exp_avg"])
    assert flat["param_groups.1.bias.weight_decay"] == 0.0 and flat["param_groups.2.weight.weight_decay"] == 0.1
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    back = to_positional(flat, groups, hyper)
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in saved["param_groups"]]
    for pos, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(back["state"][pos][key], value), (pos, key)
    # another optimizer layout (configure_optimizers changed): refused with both group sizes, nothing loaded
    fresh = torch.optim.AdamW([{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias]}])
    with pytest.raises(FormatError, match=r"param groups of \[2, 4\] parameters, .* builds \[2, 1\]"):
        from_positional(saved, optimizer_groups(model, [fresh])[0], "ckpt")


def test_not_torch_optim_format_is_refused() -> None:
    with pytest.raises(FormatError, match="not torch.optim's format"):
        from_positional({"state.x.exp_avg": torch.zeros(1)}, [["x"]], "ckpt")


def test_tied_parameters_take_the_name_torch_keys_their_state_by() -> None:
    """A tied embedding/head (as with tie_word_embeddings) has one position; torch's optimizer state dict keys it by
    its first name, and the positional round trip must use that same name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = nn.Module()
    model.emb, model.head = nn.Embedding(4, 3), nn.Linear(3, 4, bias=False)
    model.head.weight = model.emb.weight
    opt = torch.optim.AdamW(model.parameters())
    model.head(model.emb(torch.tensor([1]))).sum().backward()
    opt.step()
    groups = optimizer_groups(model, [opt])[0]
    assert groups == [["emb.weight"]]
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    back = from_positional(to_positional(flat, groups, hyper), groups, "ckpt")
    assert torch.equal(back["state.emb.weight.exp_avg"], flat["state.emb.weight.exp_avg"])
