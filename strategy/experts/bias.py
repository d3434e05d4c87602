"""Balancing experts without an auxiliary loss: a per-expert bias on each router's choice (``expert_bias_rate``).

DeepSeek-V3 (arXiv:2412.19437, section 2.1.2; torchtitan's ``load_balance_coeff``, Megatron's
``moe_router_enable_expert_bias``) adds a bias ``b_e`` to every token's score for expert ``e`` when the router
chooses its top ``k``, and only there: the chosen experts' weights are the scores as the router computed them. After
each optimizer step every layer's bias moves toward even load by a fixed rate ``u``::

    tokens_e = the (token, expert) pairs expert e received in the step, over every rank that holds other tokens
    delta_e = u * sign(mean(tokens) - tokens_e);  b += delta - mean(delta)

An overloaded expert is chosen less in the next step, an idle one more; the loss never sees the bias.

What Cuboid does, with ``CuboidStrategy(expert_bias_rate=1e-3)``:

- **Which routers.** By structure, not by class: in a block that holds a packed experts module (transformers 5's
  and Cuboid's, ``cuboid.experts.experts_modules``), the one sibling with a 2-D ``weight`` whose first dimension is
  the number of experts. A router that already keeps a 1-D buffer of that length (DeepSeek-V3's
  ``e_score_correction_bias``, which its forward adds for the choice alone) is given that buffer's updates. Any other
  (Cuboid's ``Router``, Qwen3-MoE's, Mixtral's) gets a persistent fp32 buffer ``expert_bias`` and its forward runs
  with ``torch.topk`` over the experts answered by a biased choice: the top ``k`` of ``scores + bias``, returned with
  the unbiased scores at those experts (its own normalisation then runs as written). A zero bias chooses exactly
  what the router chose before.
- **Counts.** Each router's choices are counted on the device (``index_add_``, no host read) in the forwards a step
  counts (``compat.counted_forward``: not a checkpointed recompute inside backward, not a pipeline stage's shape
  inference), over every micro-batch of gradient accumulation, until the optimizer steps.
- **The update.** An optimizer step post-hook (torch's ``register_step_post_hook``) on the optimizer that steps the
  routers' weights: every router of this rank's blocks stacked, one all-reduce (sum) of ``layers x experts`` numbers
  over the ranks that hold other tokens of the step (data parallel x context parallel: tensor-parallel peers and
  pipeline stages see the same tokens), then the rule above, on every rank alike. None inside a block.
- **Checkpoints.** The bias is a persistent buffer of the router: in every checkpoint Cuboid writes (sharded or
  full), whole on every rank, so it reloads at any other layout.
- ``imbalance``: the last update's (max / mean) tokens per expert, per layer, on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from cuboid import compat
from cuboid.experts.dispatch import pairs_per_expert
from cuboid.experts.hf import experts_modules

BUFFER = "expert_bias"


class ExpertBiasError(ValueError):
    """``expert_bias_rate`` asked of a model whose routers Cuboid cannot bias: which module, and what to do."""


@dataclass
class Router:
    """One router Cuboid biases: its name in the model, the module and its bias buffer."""

    name: str
    module: nn.Module
    bias: Tensor


def find_routers(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module, bool]]:
    """(name, router, whether it keeps its own selection bias) of every mixture-of-experts block in ``model``: the
    sibling of a packed experts module with a 2-D ``weight`` of ``num_experts`` rows. A block with no such sibling, or
    with several, is refused by name."""
    found = []
    for name, experts in experts_modules(model):
        parent_name, _, own_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        n = experts.num_experts
        candidates = [
            (child_name, child)
            for child_name, child in parent.named_children()
            if child is not experts
            and isinstance(getattr(child, "weight", None), Tensor)
            and child.weight.dim() == 2
            and child.weight.shape[0] == n
        ]
        where = f"{prefix}{parent_name or type(model).__name__}"
        if len(candidates) != 1:
            what = ", ".join(c for c, _ in candidates) or "none"
            raise ExpertBiasError(
                f"expert_bias_rate: the mixture-of-experts block {where} holds its experts in {own_name} "
                f"({n} experts) and {len(candidates)} modules that could be its router ({what}): Cuboid biases the "
                "one child beside the experts whose 2-D weight has a row per expert. Leave expert_bias_rate unset "
                "for this model, or give the block one such router."
            )
        child_name, router = candidates[0]
        own = any(b.dim() == 1 and b.shape[0] == n for b in router.buffers(recurse=False))
        found.append((f"{prefix}{parent_name + '.' if parent_name else ''}{child_name}", router, own))
    return found


def check_rate(rate: float | None) -> float | None:
    """``expert_bias_rate`` checked: None (off) or a positive number."""
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise ExpertBiasError(
            f"expert_bias_rate={rate!r}: give the step by which each expert's bias moves after each optimizer step, "
            "a positive number (DeepSeek-V3 and torchtitan use 1e-3), or leave it unset (None) for no bias."
        )
    return float(rate)


class _BiasedChoice(TorchFunctionMode):
    """Inside a router's forward: ``torch.topk`` over the experts (the last dimension, ``len(bias)`` long, largest
    first) chooses by ``scores + bias`` and returns the unbiased scores of the chosen experts."""

    def __init__(self, bias: Tensor) -> None:
        super().__init__()
        self.bias = bias
        self.used = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.topk or func is Tensor.topk:
            names = ("input", "k", "dim", "largest", "sorted")
            given = {**dict(zip(names, args, strict=False)), **kwargs}
            scores, dim = given["input"], given.get("dim", -1)
            n = self.bias.shape[0]
            if given.get("largest", True) and scores.shape[-1] == n and dim in (-1, scores.dim() - 1):
                self.used = True
                biased = scores.detach().to(torch.float32) + self.bias
                index = torch.topk(biased, given["k"], dim=-1, sorted=given.get("sorted", True)).indices
                return torch.return_types.topk((scores.gather(-1, index), index))
        return func(*args, **kwargs)


def _biased_forward(router: nn.Module, forward: Any) -> Any:
    def forward_with_bias(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        mode = _BiasedChoice(getattr(self, BUFFER))
        with mode:
            out = forward(*args, **kwargs)
        if not mode.used:
            raise ExpertBiasError(
                f"expert_bias_rate: the router {type(self).__name__} chose its experts without torch.topk over its "
                f"{mode.bias.shape[0]} experts, so Cuboid cannot add the bias to its choice. Leave expert_bias_rate "
                "unset for this model."
            )
        return out

    return MethodType(forward_with_bias, router)


def _chosen(output: Any) -> Tensor | None:
    """The (tokens, k) expert ids a router returned: the last integer tensor of its output."""
    items = output if isinstance(output, tuple | list) else (output,)
    for item in reversed(items):
        if torch.is_tensor(item) and not item.is_floating_point() and item.dim() >= 1:
            return item
    return None


class ExpertBias:
    """The experts' bias of a strategy: ``rate`` (None: off), the routers of this rank's blocks once
    :meth:`setup` found them, and the groups the counts are summed over."""

    def __init__(self, rate: float | None = None) -> None:
        self.rate = check_rate(rate)
        self.routers: list[Router] = []
        self.counts: list[Tensor | None] = []  # per router: this step's (token, expert) pairs per expert
        self.groups: list[Any] = []
        self.imbalance: Tensor | None = None
        self._hook: Any = None  # the post-hook on the routers' optimizer (a later fit's optimizers get their own)
        self._counting: list[Any] = []  # the routers' counting hooks (a later setup's replace them)

    @property
    def enabled(self) -> bool:
        return self.rate is not None

    def check(self, model: nn.Module) -> None:
        """Before the build: a model with no router Cuboid recognises is refused by name (and so is a block with an
        unclear one)."""
        if self.enabled and not find_routers(model):
            raise ExpertBiasError(
                f"expert_bias_rate={self.rate} but {type(model).__name__} has no mixture-of-experts block Cuboid "
                "recognises (a packed experts module, transformers 5's or cuboid.models.MoE's, beside a router with "
                "a row per expert). Leave expert_bias_rate unset for a dense model."
            )

    def setup(
        self, blocks: Sequence[tuple[str, nn.Module]], every: Iterable[tuple[str, Any]], device: torch.device
    ) -> None:
        """After the build: bias the routers of this rank's ``blocks`` (name, module) and count their choices;
        ``every``: (name, group) of the ranks holding other tokens of a step (data parallel x cp); ``device``: where
        the routers compute."""
        if not self.enabled:
            return
        self.groups = [group for _, group in every if dist.get_world_size(group) > 1]
        for handle in [self._hook, *self._counting]:  # an earlier fit's optimizer and routers
            if handle is not None:
                handle.remove()
        self._hook, self._counting = None, []
        self.routers, self.counts = [], []
        for block_name, block in blocks:
            for name, module, own in find_routers(block, prefix=f"{block_name}."):
                self.routers.append(self._install(name, module, own, device, len(self.routers)))
                self.counts.append(None)

    def _install(self, name: str, module: nn.Module, own: bool, device: torch.device, i: int) -> Router:
        n = module.weight.shape[0]
        if own:
            bias = next(b for b in module.buffers(recurse=False) if b.dim() == 1 and b.shape[0] == n)
        else:
            bias = getattr(module, BUFFER, None)
            if not isinstance(bias, Tensor):  # a second fit of the same model keeps the bias it learned
                module.register_buffer(BUFFER, torch.zeros(n, dtype=torch.float32, device=device), persistent=True)
                module.forward = _biased_forward(module, module.forward)
            bias = getattr(module, BUFFER)
        router = Router(name, module, bias)
        self._counting.append(module.register_forward_hook(self._counter(router, i)))
        return router

    def _counter(self, router: Router, i: int) -> Any:
        def count(module: nn.Module, _args: tuple, output: Any) -> None:
            if not (module.training and compat.counted_forward()):
                return
            index = _chosen(output)
            if index is None:
                raise ExpertBiasError(
                    f"expert_bias_rate: the router {router.name} returned no expert ids (an integer tensor), so "
                    "Cuboid cannot count the tokens each expert received. Leave expert_bias_rate unset."
                )
            counts = pairs_per_expert(index, router.bias.shape[0], torch.float32)
            self.counts[i] = counts if self.counts[i] is None else self.counts[i] + counts

        return count

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Update the bias after each step of the optimizer that steps the routers' weights (the first optimizer
        where none does: frozen routers), once."""
        optimizers = list(optimizers)
        if not self.enabled or self._hook is not None or not optimizers or not self.routers:
            return
        weights = {id(r.module.weight) for r in self.routers}
        holder = next(
            (o for o in optimizers if any(id(p) in weights for g in o.param_groups for p in g["params"])),
            optimizers[0],
        )
        self._hook = holder.register_step_post_hook(lambda *_: self.update())

    @torch.no_grad()
    def update(self) -> None:
        """The rule of the module docstring on this step's counts, summed over the groups, then the counts reset."""
        if not self.routers or all(c is None for c in self.counts):
            return
        device = self.routers[0].bias.device
        stacked = torch.stack(
            [
                c.to(device) if c is not None else torch.zeros_like(r.bias, dtype=torch.float32)
                for r, c in zip(self.routers, self.counts, strict=True)
            ]
        )
        for group in self.groups:
            dist.all_reduce(stacked, group=group)
        mean = stacked.mean(dim=1, keepdim=True)
        delta = self.rate * torch.sign(mean - stacked)
        delta = delta - delta.mean(dim=1, keepdim=True)
        for router, change in zip(self.routers, delta, strict=True):
            router.bias.add_(change.to(router.bias.dtype))
        self.counts = [None] * len(self.routers)
        self.imbalance = stacked.max(dim=1).values / mean.squeeze(1).clamp(min=1e-12)
