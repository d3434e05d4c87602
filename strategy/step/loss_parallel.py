"""Loss parallel: cross-entropy on logits that stay sharded over the vocabulary, with the user's step unchanged.

A plan entry ``"output": "loss_parallel"`` keeps the output projection's logits vocabulary-sharded (a DTensor on the
tp mesh) instead of all-gathering them: with a 128k vocabulary that gather is the largest activation of the model.
``F.cross_entropy`` on such logits is computed shard by shard under torch's ``loss_parallel()`` context, which the
strategy enters around the step hooks and the backward. Within a step, ``F.cross_entropy`` (what
``nn.CrossEntropyLoss`` and Hugging Face losses call) returns a plain tensor again (the loss is replicated over tp;
its gradient still flows into the sharded computation), so torchmetrics, Lightning's logging, callbacks and
checkpoint monitors never see a DTensor loss; other DTensor values the step logs or returns are made plain too.

What changes for user code: ``self.model(x)`` returns a DTensor under tensor parallel. Cross-entropy works as is;
code that mixes logits with plain tensors (an accuracy on ``logits.argmax(-1)``) needs ``logits.full_tensor()``,
or a plan with ``"output": "output"`` (logits gathered, plain). Under pipeline parallel the last stage's logits
stay sharded too: the schedule (its loss function on the last stage, and its backward) runs inside the same
context.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def plain(value: Any) -> Any:
    """A DTensor as the plain tensor Lightning can log: this rank's copy when replicated, else gathered."""
    if not isinstance(value, DTensor):
        return value
    if all(p.is_replicate() for p in value.placements):
        return value.to_local()
    return value.full_tensor()


def plain_output(output: Any) -> Any:
    """A step's return value with a DTensor loss made plain (gradients still flow into the DTensor graph)."""
    if isinstance(output, DTensor):
        return plain(output)
    if isinstance(output, dict) and isinstance(output.get("loss"), DTensor):
        return {**output, "loss": plain(output["loss"])}
    return output


class LossParallel:
    """Whether the plan keeps logits vocabulary-sharded; the contexts the strategy's step hooks run in."""

    def __init__(self) -> None:
        self.enabled = False
        self.inside = False  # within step(): a backward there (manual optimization's) is already under the context

    @contextmanager
    def step(self, lm: Any, log: bool = True) -> Generator[None, None, None]:
        """Run a step hook under ``loss_parallel()``, its ``self.log``/``self.log_dict`` values made plain (``log``;
        under pp the pipeline's own log recorder makes them plain)."""
        if not self.enabled:
            yield
            return
        if log:
            lm_log, lm_log_dict = lm.log, lm.log_dict

            def plain_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
                lm_log(name, plain(value), *args, **kwargs)

            def plain_log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
                lm_log_dict({k: plain(v) for k, v in dictionary.items()}, *args, **kwargs)

            lm.__dict__["log"], lm.__dict__["log_dict"] = plain_log, plain_log_dict
        original = F.cross_entropy

        @functools.wraps(original)  # __wrapped__: context parallel's interception finds torch's own function
        def cross_entropy(input: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(input, *args, **kwargs)
            if not isinstance(input, DTensor):
                return out
            # (a copy, not to_local's view: the step returns this loss, and FSDP2 warns on every step that a unit's
            # output is a view, whose in-place change would drop its pre-backward hook)
            loss = plain(out)
            return loss.clone() if loss._base is not None else loss

        F.cross_entropy = cross_entropy  # looked up at call time by F users, nn.CrossEntropyLoss and transformers
        self.inside = True
        try:
            with loss_parallel():
                yield
        finally:
            self.inside = False
            F.cross_entropy = original
            if log:
                del lm.__dict__["log"], lm.__dict__["log_dict"]

    def backward(self) -> AbstractContextManager[None]:
        """The backward's context: ``loss_parallel()``, unless the step's is still open (manual optimization's
        ``manual_backward`` inside ``training_step``: torch's context does not nest, its exit dropped its handlers
        twice, a KeyError)."""
        return loss_parallel() if self.enabled and not self.inside else nullcontext()


__all__ = ["LossParallel", "plain", "plain_output"]
