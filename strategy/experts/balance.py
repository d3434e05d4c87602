"""The load-balancing loss of a transformers mixture-of-experts model, over the tokens of the whole step.

transformers' MoE models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, ...: ``load_balancing_loss_func``) add to ``.loss``
``router_aux_loss_coef x E x sum_e f_e P_e``: ``f_e`` the share of the (token, expert) choices that went to expert
``e`` and ``P_e`` its mean router probability, both over every layer's rows of the batch, padding left out. That is
a batch statistic: computed on one rank's tokens and averaged over ranks, it is not the loss of the step's batch.
As SyncBatchNorm does, Cuboid sums the statistic's parts (per-expert choice counts, probability sums and the rows:
``2E + 1`` numbers) over every rank that holds different tokens of the step (``dp_replicate x dp_shard x cp``)
before the product (``load_balancing="global"``, the default, as the design asks and Qwen's authors recommend).
``"local"`` keeps each data-parallel rank's own batch (what DDP computes; cp peers are still summed, since they
share one batch).

Cuboid computes those parts from the router logits the model returns, as the model's own function does, and checks
on the first forward that its formula gives the model's own ``aux_loss`` on this rank's rows (a family whose loss
has another form is refused there, by name). The model's own term is swapped for the whole step's:
``loss - coef x aux_loss + coef x whole``, with ``aux_loss`` replaced in the output. The sum's backward is this
rank's share of a loss every rank computes alike: the gradient times the number of ranks, which the gradient mean
over them divides away again; no collective in the backward, one all-reduce of ``2E + 1`` numbers per forward.
Under pipeline parallel the stages send the parts along (:mod:`cuboid.pipeline.decoder`).

A model of Cuboid's own that computes its load-balancing loss per block (``cuboid.models.MoE``: ``balance_parts``
and ``balance_loss(parts)``) gets the same, with no collective inside a block: each block's forward only notes that
it ran, and once the model's forward is over (a forward hook on the model; a pipeline stage calls
:func:`settle_block_losses` before it reads them) every noted block's parts are stacked, summed over the ranks in one
all-reduce of ``layers x (2E + 1)`` numbers, and each block's ``aux_loss`` is remade from its row. The sums, and so
the loss and its gradient, are the ones a collective per block made.

The ranks are one group (``dp_cp``: data parallel x cp, flattened), so a sum is one collective.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cuboid.experts.dispatch import ExpertParallelError

MODES = ("global", "local")
_ACTIVE: list[LoadBalancing] = []


def active() -> LoadBalancing | None:
    """The load balancing of the step running now (None outside a step: nothing is summed over ranks)."""
    return _ACTIVE[-1] if _ACTIVE else None


def router_loss_model(model: nn.Module) -> bool:
    """Whether ``model`` adds transformers' load-balancing loss to its loss (and names what Cuboid needs)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 1))


def check_router_loss_model(model: nn.Module) -> None:
    """Refuse a model that adds a load-balancing loss without the attributes transformers' MoE models weigh and
    compute it with (``router_aux_loss_coef``, ``num_experts``, ``num_experts_per_tok``)."""
    missing = [
        name
        for name in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
        if not isinstance(getattr(model, name, None), int | float)
    ]
    if missing:
        raise ExpertParallelError(
            f"{type(model).__name__} adds a load-balancing loss (config.output_router_logits=True) but has no "
            f"{', '.join(missing)} attribute, which transformers' mixture-of-experts models compute and weigh it "
            "with, so Cuboid cannot sum it over the step's tokens. Train without it (config.output_router_logits="
            "False), or ask for this family."
        )


def statistics(router_logits: Sequence[Tensor], experts: int, top_k: int, mask: Tensor | None) -> Tensor:
    """``[counts (E), probability sums (E), rows (1)]`` of ``router_logits`` (one ``(rows, E)`` tensor per layer),
    accumulated as transformers' ``load_balancing_loss_func`` does (rows weighted by a 0/1 padding ``mask``)."""
    device = router_logits[0].device if router_logits else (mask.device if mask is not None else None)
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    flat = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in router_logits:
        weights = torch.softmax(layer, dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        ones = torch.ones(chosen.numel(), device=device) if flat is None else flat.unsqueeze(1).expand(-1, top_k)
        ones = ones.reshape(-1)  # (each row's weight for each of its k choices)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), ones)
        probs = probs + (weights.float() if flat is None else weights.float() * flat.unsqueeze(-1)).sum(dim=0)
        rows = rows + (weights.shape[0] if flat is None else flat.sum())
    return torch.cat([counts, probs, rows])


def loss_of(parts: Tensor, experts: int) -> Tensor:
    """transformers' load-balancing loss from :func:`statistics` (summed over any number of ranks or stages)."""
    rows = parts[2 * experts]
    return torch.sum(parts[:experts] / rows * (parts[experts : 2 * experts] / rows)) * experts


def settle_block_losses() -> None:
    """The running step's blocks that ran since the last call get their ``aux_loss`` over the step's tokens (see the
    module docstring); nothing outside a step."""
    balance = active()
    if balance is not None:
        balance.settle_blocks()


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over ``groups`` in turn; backward: the gradient times ``ranks`` (every rank computes the
    same loss from the sum; the gradient mean over the ranks divides it away). No collective in the backward."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, groups: list[Any], ranks: int) -> Tensor:
        ctx.ranks = ranks
        total = local.detach().clone()
        for group in groups:
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad * ctx.ranks, None, None


class LoadBalancing:
    """Where a strategy's load-balancing statistic is summed: ``mode`` (``"global"`` / ``"local"``), set up with
    the groups of ranks holding different tokens; :meth:`step` around every step."""

    def __init__(self, mode: str = "global") -> None:
        if mode not in MODES:
            raise ValueError(
                f"load_balancing={mode!r}; choose 'global' (the load-balancing loss over the whole step's tokens, "
                "as one process computes it) or 'local' (each data-parallel rank's own batch, as DDP does)."
            )
        self.mode = mode
        self.groups: list[Any] = []
        self.ranks = 1
        self._checked = False
        self._padding: Callable[[], Tensor | None] | None = None
        self._ran: dict[nn.Module, None] = {}  # the blocks whose forward ran since the last settle_blocks, in order

    def setup(
        self,
        lm: nn.Module,
        blocks: Sequence[tuple[str, nn.Module]],
        every: list[tuple[str, Any]],
        cp: list[tuple[str, Any]],
        plain: bool,
        padding: Callable[[], Tensor | None] | None = None,
        root: nn.Module | None = None,
    ) -> None:
        """``lm``'s model (the child holding the ``blocks``; ``root`` when given, as under Fabric, where the module
        set up is the model). ``every`` / ``cp``: (name, group) of all the ranks that hold different tokens of a step
        (data parallel x cp), and of cp alone.
        ``plain``: no pipeline, so the model's output is adjusted by a forward hook (a pipeline's last stage computes
        the loss itself). ``padding``: under cp, this rank's share of the step's padding mask (the model itself is
        given none), else None."""
        if not blocks:
            return
        model = root if root is not None else lm.get_submodule(blocks[0][0].split(".")[0])
        self._padding = padding
        chosen = every if self.mode == "global" else cp
        self.groups = [group for _, group in chosen if dist.get_world_size(group) > 1]
        self.ranks = 1
        for group in self.groups:
            self.ranks *= dist.get_world_size(group)
        if plain and self.groups and router_loss_model(model):  # alone, the model's own loss is the whole step's
            check_router_loss_model(model)
            model.register_forward_hook(self._swap_loss, with_kwargs=True)
        weighted = getattr(getattr(model, "cfg", None), "aux_loss_coef", 1)  # Cuboid's Llama: 0 leaves it out
        if self.groups and weighted:  # a block that computes its own load-balancing loss from parts (Cuboid's MoE)
            found = False
            for module in model.modules():
                if hasattr(module, "balance_parts") and callable(getattr(module, "balance_loss", None)):
                    module.register_forward_hook(self._note_block)
                    found = True
            if found and plain:  # under pp each stage settles its own blocks (settle_block_losses)
                model.register_forward_hook(lambda *_: self.settle_blocks() if active() is self else None)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its process groups (the running job's)."""
        return {**vars(self), "groups": []}

    @contextmanager
    def step(self) -> Generator[None, None, None]:
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()

    @property
    def checked(self) -> bool:
        """Whether :meth:`check` has compared the two formulas (on finite values)."""
        return self._checked

    def whole(self, parts: Tensor) -> Tensor:
        """``parts`` summed over the ranks that hold the step's other tokens (differentiable)."""
        return _SumOverRanks.apply(parts, self.groups, self.ranks) if self.groups else parts

    def check(self, model: nn.Module, own: Tensor, mine: Tensor) -> None:
        """Once: Cuboid's formula (``mine``) gives the model's own ``aux_loss`` (``own``) on the same rows (one host
        read; not counted while they are not finite, as on a pipeline's shape inference of made-up inputs)."""
        if self._checked:
            return
        theirs, ours = torch.stack([own.detach().float().reshape(()), mine.detach().float().reshape(())]).tolist()
        if not (math.isfinite(theirs) and math.isfinite(ours)):
            return
        self._checked = True
        if not math.isclose(theirs, ours, rel_tol=1e-4, abs_tol=1e-6):
            raise ExpertParallelError(
                f"{type(model).__name__}'s load-balancing loss is not transformers' load_balancing_loss_func "
                f"(it gave {theirs:.6g} where that function gives {ours:.6g} on the same router logits), so Cuboid "
                "cannot sum it over the step's tokens. Use load_balancing='local' without context or pipeline "
                "parallel, or train without it (config.output_router_logits=False)."
            )

    def _note_block(self, module: nn.Module, _args: tuple, _output: Any) -> None:
        """A block's forward ran in the step (its parts are summed later, with every other block's)."""
        if active() is self and module.balance_parts is not None:
            self._ran[module] = None

    def settle_blocks(self) -> None:
        """Every block noted since the last call: its ``aux_loss`` from its parts summed over the step's ranks, all
        blocks' parts in one all-reduce. A block recomputed by activation checkpointing inside a step (a pipeline
        schedule runs backward there) is noted again: the same blocks, on every rank of the sum, so the next call
        stacks as many rows everywhere."""
        if not self._ran:
            return
        blocks, self._ran = list(self._ran), {}
        summed = self.whole(torch.stack([block.balance_parts for block in blocks]))
        for block, parts in zip(blocks, summed.unbind(0), strict=True):
            block.aux_loss = block.balance_loss(parts)

    def _swap_loss(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if active() is not self or getattr(output, "router_logits", None) is None:
            return None
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
        mask = bound.get("attention_mask")
        experts, top_k = module.num_experts, module.num_experts_per_tok
        mine = statistics(output.router_logits, experts, top_k, mask)
        self.check(module, output.aux_loss, loss_of(mine, experts))
        padding = self._padding() if self._padding is not None else None
        if padding is not None:  # the model got no mask (under cp): this rank's rows of the step's
            mine = statistics(output.router_logits, experts, top_k, padding)
        whole = loss_of(self.whole(mine), experts)
        if output.loss is not None:
            coef = module.router_aux_loss_coef
            output.loss = output.loss - coef * output.aux_loss + coef * whole
        output.aux_loss = whole
        return output
