"""Context parallel inside a user's unchanged step: the model sees its rank's share of each sequence, attention
sees every rank's keys and values, and the loss is the whole sequence's.

Three interceptions, all undone when the step ends, none an edit to the model or the step:

- **The model's inputs.** A forward pre-hook on the LightningModule's model (the module holding the blocks, e.g.
  ``self.model``) cuts its first tensor argument (``input_ids``, tokens, ``inputs_embeds``) and every other
  ``(batch, seq)`` argument to this rank's load-balanced share, passes each token's *global* position as
  ``position_ids`` (so rotary embeddings rotate by the true position), keeps ``labels`` whole and takes
  ``attention_mask`` aside (its padding is applied to the gathered keys).
- **Attention.** ``F.scaled_dot_product_attention`` calls (plain PyTorch models: Cuboid's Llama, litgpt) go to
  :func:`~cuboid.context.attention.cp_attention` through a ``TorchFunctionMode``; transformers models run the
  ``"cuboid_cp"`` function of transformers' own attention registry (:mod:`cuboid.context.hf`).
- **The loss.** ``F.cross_entropy`` / ``F.nll_loss`` on this rank's logits against the *whole* sequence's targets
  (what a step that shifts ``batch[:, 1:]`` itself, or transformers' loss that shifts ``labels``, passes) takes
  this rank's targets, computes per-token losses, gathers them back in global order and reduces them as asked.
  The value is the non-context-parallel loss on every cp rank (``-100`` targets and weights counted over the whole
  sequence), and its gradient, after FSDP's mean over ``dp_shard x cp``, is exact.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from cuboid.context import hf
from cuboid.context.attention import (
    ContextParallelError,
    check_attention,
    cp_attention,
    gather_tokens,
    local_positions,
)
from cuboid.context.cross import cut_along_sequence
from cuboid.context.current import KEY_PADDING, active, running

_LOSSES: tuple[Callable[..., torch.Tensor], ...] = (F.cross_entropy, F.nll_loss)


class ContextParallel:
    """The context-parallel side of one strategy: ``dims.cp`` ranks share every sequence (refused, by
    :func:`_check_composes`, with what it does not compose with yet). ``setup`` after the model is parallelized;
    ``step()`` around every training, validation and test step (and, under pp, the schedule). Activation
    checkpointing's recompute re-enters the forward's interception itself (:func:`cuboid.parallel.parallelize.apply_ac`).
    """

    def __init__(self, dims: Any, compile: bool = False, activation_checkpointing: str | None = None) -> None:
        _check_composes(dims.cp, compile, activation_checkpointing)
        self.dims = dims  # the run's one record of its degrees (ParallelDims, or a Layout): cp is read from it
        self.group: dist.ProcessGroup | None = None
        self.rank = 0
        self.positions_keyword = "position_ids"
        self._seq: tuple[int, int] | None = None  # (batch, seq_len) of the last forward this step
        self._key_padding: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None  # the last forward's whole (batch, seq) padding mask, if any
        self._attention_seen = False  # set (never read) by attention: a compiled block gets no guard on it
        self._checked = self._inside = False
        self._transformers = False  # a transformers model: the padding mask rides along as KEY_PADDING
        self.cut_masks: set[int] = set()  # key counts of the masks cut by their rows (cuboid.context.cross)

    @property
    def size(self) -> int:
        """The ranks each sequence is split over (``cp``)."""
        return self.dims.cp

    @property
    def enabled(self) -> bool:
        return self.dims.cp > 1

    def __getstate__(self) -> dict[str, Any]:  # pickled without its process group (the running job's)
        return {**vars(self), "group": None}

    def setup(
        self,
        lm: nn.Module,
        blocks: list[str],
        group: dist.ProcessGroup,
        runner: Any = None,
        root: nn.Module | None = None,
    ) -> None:
        """Hook the LightningModule's model (its child that holds the ``blocks``, e.g. ``self.model``: the module
        whose forward takes the token ids; ``root`` when given, as under Fabric, where the module set up is the
        model) and run its attention across ``group``. ``runner``: under pp, the pipeline's runner, which calls the
        stages and cuts their inputs with :meth:`pipeline_inputs` (no hook)."""
        if not blocks:
            raise ContextParallelError(
                f"context_parallel={self.size}: Cuboid found no repeated blocks in {type(lm).__name__}, so no model "
                "to split the sequence for. Name them with block_container='model.layers', or use context_parallel=1."
            )
        root = root if root is not None else lm.get_submodule(blocks[0].split(".")[0])
        root = hf.language_model(root, lm, blocks, pipelined=runner is not None)
        check_attention(root, self.size)
        self.group, self.rank = group, dist.get_rank(group)
        self.positions_keyword = positions_keyword(root)
        self._transformers = hf.use_cp_attention(root)
        if runner is not None:  # (the runner was handed this runtime when made: it cuts the schedule's inputs)
            for stage in runner.stages:  # a stage's base model has a config of its own: it builds no mask either
                hf.use_cp_attention(stage.submod)
        else:
            root.register_forward_pre_hook(self._shard_inputs, with_kwargs=True, prepend=True)

    @contextmanager
    def step(self) -> Generator[None, None, None]:
        """Within: the model's inputs are cut to this rank's share, attention and the loss span every rank."""
        if not self.enabled:
            yield
            return
        self._seq = None  # until the model's sequence is cut (a vision tower before it runs on whole images)
        with running(self), _Interceptor(self):
            yield
        if self._seq is not None and not self._checked:
            self._checked = True
            if not self._attention_seen:
                raise ContextParallelError(
                    f"context_parallel={self.size}: the model ran without one attention call Cuboid can split. "
                    "Context parallel replaces torch.nn.functional.scaled_dot_product_attention (plain PyTorch "
                    "models) and transformers' attention functions; a model whose attention is written out by "
                    "hand (softmax(q @ k.T)) or runs nn.MultiheadAttention cannot be split. Call "
                    "F.scaled_dot_product_attention(q, k, v, is_causal=True) in the model, or use context_parallel=1."
                )

    # ------------------------------------------------------------------ the model's inputs
    def _shard_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if active() is not self:
            return None
        signature = inspect.signature(module.forward)
        bound = signature.bind(*args, **kwargs)
        named, var_keyword = bound.arguments, _var_keyword(signature)
        values = {**{k: v for k, v in named.items() if k != var_keyword}, **named.get(var_keyword, {})}
        first = next((k for k in ("input_ids", "inputs_embeds") if isinstance(values.get(k), torch.Tensor)), None)
        if first is None:
            first = next((k for k, v in values.items() if isinstance(v, torch.Tensor) and k != "labels"), None)
        tokens = values.get(first) if first is not None else None
        if tokens is None or tokens.dim() < 2:
            shape = "no tensor" if tokens is None else f"a tensor of shape {tuple(tokens.shape)}"
            raise ContextParallelError(
                f"context_parallel={self.size} splits each sequence along dim 1, but the model's first input is "
                f"{shape}: a batch without a sequence dimension. Pass (batch, seq) token ids, or use "
                "context_parallel=1."
            )
        batch, seq_len = tokens.shape[:2]
        positions = local_positions(seq_len, self.rank, self.size, tokens.device)
        self._seq = (batch, seq_len)
        mask = values.pop("attention_mask", None)
        if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (batch, seq_len)):
            raise ContextParallelError(
                f"context_parallel={self.size} cannot split an attention_mask of shape {tuple(mask.shape)}: only a "
                f"(batch, seq) padding mask ({batch}, {seq_len}) is applied across ranks. Drop custom 4-D masks, or "
                "use context_parallel=1."
            )
        changed: dict[str, Any] = {}
        if mask is not None:
            changed["attention_mask"] = None
            if self._transformers:  # through transformers' kwargs to the attention function, call by call
                changed[KEY_PADDING] = mask
        self._key_padding = None if self._transformers else mask
        self.padding = mask
        self.cut_masks = set()
        for name, value in values.items():
            mine = cut_along_sequence(name, value, first, batch, seq_len, positions, self.cut_masks)
            if mine is not None:
                changed[name] = mine
            elif name == self.positions_keyword and torch.is_tensor(value):  # Qwen2-VL's (sections, batch, seq)
                if tuple(value.shape[-2:]) != (batch, seq_len):
                    raise ContextParallelError(
                        f"context_parallel={self.size} cannot split {name} of shape {tuple(value.shape)}: positions "
                        f"are cut with the ({batch}, {seq_len}) sequence, as (batch, seq) or (..., batch, seq)."
                    )
                changed[name] = value.index_select(-1, positions)
        if self.positions_keyword not in changed:
            changed[self.positions_keyword] = positions.unsqueeze(0).expand(batch, -1)
        kinds = {p.kind for p in signature.parameters.values()}
        if not kinds & {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL}:
            # By keyword: a decorator around a transformers forward may fill a keyword it does not find (use_cache)
            return (), {**values, **changed}
        for name, value in changed.items():
            if name in signature.parameters and name != var_keyword:
                named[name] = value
            else:
                named.setdefault(var_keyword, {})[name] = value
        return bound.args, bound.kwargs

    def local_padding(self, mask: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a whole ``(batch, seq)`` padding mask, in the order its rows run."""
        return mask.index_select(1, local_positions(mask.shape[1], self.rank, self.size, mask.device))

    def step_padding(self) -> torch.Tensor | None:
        """This rank's share of the running step's padding mask (None without one, or outside a step)."""
        return None if active() is not self or self.padding is None else self.local_padding(self.padding)

    def gather_output(self, output: Any) -> Any:
        """The model's output with every tensor of this rank's ``(batch, local tokens, ...)`` made whole again
        (``(batch, seq, ...)``, global order; differentiable): for a loss computed after the forward, outside the
        step (a Fabric loop). Tensors, tuples, lists and mappings (a transformers ``ModelOutput``) are walked."""
        if not self.enabled or self._seq is None or self.group is None:
            return output
        batch, seq_len = self._seq
        local = seq_len // self.size

        def whole(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, local):
                return gather_tokens(value, self.group)
            if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
                return type(value)(whole(v) for v in value)
            if isinstance(value, Mapping):
                fields = {k: whole(v) for k, v in value.items()}
                return type(value)(**fields) if type(value) is not dict else fields
            return value

        return whole(output)

    def pipeline_inputs(
        self, first: tuple, stage_kwargs: dict[str, Any], tokens: torch.Tensor, microbatches: int
    ) -> tuple[tuple, dict[str, Any]]:
        """The pipeline schedule's inputs cut to this rank's share: the first stage's ``(batch, seq)`` tensors and
        every stage's keyword tensors, with global ``position_ids`` added; a transformers model's
        ``attention_mask`` travels whole to its attention function. ``tokens``: the step's token ids."""
        batch, seq_len = tokens.shape[:2]
        positions = local_positions(seq_len, self.rank, self.size, tokens.device)
        self._seq = (batch // microbatches, seq_len)

        def cut(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == (batch, seq_len):
                return value.index_select(1, positions)
            return value

        kwargs: dict[str, Any] = {}
        for name, value in stage_kwargs.items():
            if name == "attention_mask" and value is not None:
                kwargs[KEY_PADDING] = value
            else:
                kwargs[name] = cut(value)
        kwargs.setdefault(self.positions_keyword, positions.unsqueeze(0).expand(batch, -1).contiguous())
        return tuple(cut(t) for t in first), kwargs

    # ------------------------------------------------------------------ attention and the loss
    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        is_causal: bool = True,
        scale: float | None = None,
        enable_gqa: bool = False,
        dropout_p: float = 0.0,
        key_padding: torch.Tensor | None = None,
        window: int | None = None,
        sink: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Exact attention of this rank's queries over the whole sequence (padding from ``attention_mask``: the
        step's, or ``key_padding`` given with this call; ``window``: a causal sliding window; ``sink``: an attention
        sink's logit per query head; ``softcap``: soft-capped scores)."""
        assert self.group is not None
        self._attention_seen = True  # a store, not a count: reading it would make Dynamo recompile per call
        seq_len = query.shape[2] * self.size
        if self._seq is not None and seq_len != self._seq[1]:
            raise ContextParallelError(
                f"context_parallel={self.size}: an attention call over {query.shape[2]} local tokens does not match "
                f"the model's input of {self._seq[1]} tokens per sequence ({self._seq[1] // self.size} per rank). "
                "Only self-attention over the model's own sequence can be split; use context_parallel=1."
            )
        self._inside = True  # its own scaled_dot_product_attention call is not intercepted again
        try:
            padding = key_padding if key_padding is not None else self._key_padding
            return cp_attention(
                query, key, value, self.group, seq_len, is_causal, scale, enable_gqa, padding, dropout_p, window, sink,
                softcap,
            )  # fmt: skip
        finally:
            self._inside = False

    def sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention``'s signature, across the cp ranks."""
        if attn_mask is not None:
            raise ContextParallelError(
                f"context_parallel={self.size}: the model calls scaled_dot_product_attention with an explicit "
                f"attn_mask of shape {tuple(attn_mask.shape)}, built for this rank's tokens only; Cuboid cannot "
                "split it. Call it with is_causal=True (padding: pass attention_mask to the model's forward), or use "
                "context_parallel=1."
            )
        return self.attention(query, key, value, is_causal, scale, enable_gqa, dropout_p)

    def loss(self, func: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        """A cross-entropy or NLL loss of this rank's logits against the whole sequence's targets, exact."""
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        logits, target = a["input"], a["target"]
        assert self._seq is not None and self.group is not None
        batch, seq_len = self._seq
        local = seq_len // self.size
        flat = (batch * local, batch * seq_len)
        if logits.dim() == 2 and target.dim() == 1 and (logits.shape[0], target.shape[0]) == flat:
            full_target = target.view(batch, seq_len)
        elif logits.dim() == 3 and target.dim() == 2 and (logits.shape[0], logits.shape[2]) == (batch, local):
            full_target = target
        else:
            return func(*args, **kwargs)  # not a loss over this sequence's tokens
        if tuple(full_target.shape) != (batch, seq_len) or full_target.dtype.is_floating_point:
            raise ContextParallelError(
                f"context_parallel={self.size}: {func.__name__} with class-probability targets cannot be split; "
                "pass class indices, or use context_parallel=1."
            )
        if a.get("size_average") is not None or a.get("reduce") is not None:
            raise ContextParallelError(f"{func.__name__}: use reduction=, not the deprecated size_average/reduce.")
        positions = local_positions(seq_len, self.rank, self.size, target.device)
        mine = full_target.index_select(1, positions)
        a["target"] = mine.reshape(-1) if target.dim() == 1 else mine
        reduction, a["reduction"] = a["reduction"], "none"
        mine_per_token = func(**a)
        if isinstance(mine_per_token, DTensor):  # loss parallel: vocabulary-sharded logits, each token's loss whole
            mine_per_token = mine_per_token.to_local()  # (replicated over tp; its gradient flows to the shards)
        per_token = gather_tokens(mine_per_token.view(batch, local), self.group)  # (batch, seq_len), global order
        if reduction == "none":
            return per_token.reshape(target.shape)
        if reduction == "sum":
            return per_token.sum()
        counted = full_target != a["ignore_index"]
        weight = a.get("weight")
        if weight is not None:
            denominator = (weight[full_target.clamp(min=0)] * counted).sum()
        else:
            denominator = counted.sum()
        return per_token.sum() / denominator


class _Interceptor(TorchFunctionMode):
    """Sends attention and sequence losses of a step to its :class:`ContextParallel`; all else runs as called."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.cp._seq is not None and not self.cp._inside:
            # (a transformers model's split attention is its "cuboid_cp" function: its vision tower's is its own)
            if func is F.scaled_dot_product_attention and not self.cp._transformers:
                return self.cp.sdpa(*args, **kwargs)
            loss = getattr(func, "__wrapped__", func)  # loss parallel's F.cross_entropy wraps torch's
            if loss in _LOSSES:
                return self.cp.loss(loss, *args, **kwargs)
        return func(*args, **kwargs)


def _check_composes(size: int, compile: bool, activation_checkpointing: str | None) -> None:
    """Refuse what context parallel does not compose with yet: compiled blocks *with* activation checkpointing
    (Dynamo traces the checkpoint without the step's interception, so attention would see only this rank's tokens)."""
    if size > 1 and compile and activation_checkpointing is not None:
        raise ContextParallelError(
            f"context_parallel={size} with compile=True and activation_checkpointing={activation_checkpointing!r} is "
            "not supported yet: a compiled, checkpointed block runs attention outside Cuboid's context-parallel "
            "interception. Use compile=True without activation checkpointing, or activation checkpointing without "
            "compile."
        )


def positions_keyword(model: nn.Module) -> str:
    """The keyword under which ``model.forward`` takes each token's position (``position_ids``), or a
    :class:`ContextParallelError` that says why context parallel needs one."""
    params = inspect.signature(model.forward).parameters
    if "position_ids" in params:
        return "position_ids"
    raise ContextParallelError(
        f"context_parallel needs the model's forward to take position_ids: each rank holds tokens from two places "
        f"in the sequence and must tell the model their global positions (rotary or learned embeddings). "
        f"{type(model).__name__}.forward{inspect.signature(model.forward)} takes none. Add a position_ids argument "
        "(as transformers models and Cuboid's Llama have), or use context_parallel=1."
    )


def _var_keyword(signature: inspect.Signature) -> str:
    for name, p in signature.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return name
    return "\0none"
