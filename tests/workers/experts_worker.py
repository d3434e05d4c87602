"""Expert parallel's exchange against the unsharded layer, on every ep rank (a torchrun worker).

For transformers' Qwen3-MoE, Mixtral and GPT-OSS experts (packed; GPT-OSS transposed, biased, interleaved gate):
each rank keeps its block of experts (``shard_experts``) and runs its own tokens. Checked against the whole layer
run on every rank's tokens in this process: each rank's output and input gradient, each local expert's gradient
(summed over every rank's tokens, which reach it through the all-to-all's backward), and the router's gradient
summed over ranks. Two routings: forced (rank 0's tokens all go to experts that rank 0 does not hold, one expert
gets no token anywhere, and some pairs carry the sentinel id of a dropped pair) and the layer's own router.

Writes, from rank 0, the largest relative difference per family and routing, and each rank's split sizes under
the forced routing, to ``sys.argv[1]``.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from cuboid.experts import dispatch, expert_block, experts_modules, shard_experts
from cuboid.job.launch import close_process_groups

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 16, 8, 4, 2, 12


def blocks() -> dict[str, torch.nn.Module]:
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    qwen = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, norm_topk_prob=True)  # fmt: skip
    mixtral = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                            num_experts_per_tok=TOP_K)  # fmt: skip
    gpt_oss = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K)  # fmt: skip
    made = {}
    for name, (cls, config) in {"qwen3_moe": (Qwen3MoeSparseMoeBlock, qwen), "mixtral": (MixtralSparseMoeBlock, mixtral),
                                "gpt_oss": (GptOssMLP, gpt_oss)}.items():  # fmt: skip
        torch.manual_seed(0)
        block = cls(config)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.5)
        made[name] = block
    return made


def forced_routing(rank: int, ep: int, sentinel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's pairs all go to the last rank's experts; the others spread over experts 0 and the last rank's,
    expert 1 gets none anywhere, and with ``sentinel`` the last token of rank 1 has a dropped pair (id = EXPERTS;
    only Qwen3-MoE's own layer takes such ids)."""
    g = torch.Generator().manual_seed(100 + rank)
    last = list(range(*expert_block(EXPERTS, ep, ep - 1)))
    choices = last if rank == 0 else [0, *last]
    index = torch.tensor([[choices[(t + j) % len(choices)] for j in range(TOP_K)] for t in range(TOKENS)])
    if sentinel and rank == 1:
        index[-1, -1] = EXPERTS
    weights = torch.rand(TOKENS, TOP_K, generator=g)
    return index, weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run(name: str, whole: torch.nn.Module, forced: bool, rank: int, ep: int) -> dict[str, float]:
    inputs = [torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7 + r)) for r in range(ep)]
    grads = [torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(70 + r)) for r in range(ep)]
    routes = [forced_routing(r, ep, sentinel=name == "qwen3_moe") for r in range(ep)]
    experts_name, _ = next(experts_modules(whole))
    mine = copy.deepcopy(whole)
    start, stop = shard_experts(mine.get_submodule(experts_name), dist.group.WORLD)

    def call(block: torch.nn.Module, x: torch.Tensor, r: int) -> torch.Tensor:
        if forced:  # the experts module alone, on the forced routing
            return block.get_submodule(experts_name)(x, *routes[r])
        out = block(x.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).squeeze(0)

    refs, ref_x = [], []
    for r in range(ep):
        x = inputs[r].clone().requires_grad_()
        out = call(whole, x, r)
        (out * grads[r]).sum().backward()
        refs.append(out.detach())
        ref_x.append(x.grad)
    x = inputs[rank].clone().requires_grad_()
    out = call(mine, x, rank)
    (out * grads[rank]).sum().backward()
    worst = {"out": rel(out, refs[rank]), "dx": rel(x.grad, ref_x[rank])}
    for (pname, p), (_, q) in zip(mine.named_parameters(), whole.named_parameters(), strict=True):
        if pname.startswith(experts_name + "."):
            worst[f"d{pname.rsplit('.', 1)[1]}"] = rel(p.grad, q.grad[start:stop])
        elif not forced:  # the router: each rank's gradient from its own tokens; their sum is the whole layer's
            summed = p.grad.clone()
            dist.all_reduce(summed)
            worst[f"d{pname}"] = rel(summed, q.grad)
    return worst


def main() -> None:
    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, whole in blocks().items():
        for forced in (True, False):
            results[f"{name}/{'forced' if forced else 'router'}"] = run(name, copy.deepcopy(whole), forced, rank, ep)
    index, _ = forced_routing(rank, ep, sentinel=True)
    _, counts, routed = dispatch(torch.randn(TOKENS, HIDDEN), index, EXPERTS, dist.group.WORLD)
    splits = {"send": routed.send_splits, "recv": routed.recv_splits, "per_local_expert": counts}
    everyone = [None] * ep
    dist.all_gather_object(everyone, (results, splits))
    if rank == 0:
        merged = {k: {m: max(w[0][k][m] for w in everyone) for m in results[k]} for k in results}
        merged["splits"] = [w[1] for w in everyone]
        with open(sys.argv[1], "w") as f:
            json.dump(merged, f, indent=1)
    dist.barrier()  # no rank tears gloo down while another may still be in a collective
    close_process_groups()  # destroyed, and no gloo thread still at work when the interpreter finalizes


if __name__ == "__main__":
    main()
