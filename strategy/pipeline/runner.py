"""The pipelined step: a LightningModule's own step hook, run through a ``torch.distributed.pipelining`` schedule.

The user's ``training_step`` / ``validation_step`` runs unchanged. Cuboid first calls it with a stand-in model that
records how it calls the model and stops (on the first stage, and on every stage for a Hugging Face decoder, whose
stages all need the call's ``attention_mask`` and positions); then the schedule runs the stages, and on the last
stage the schedule's loss function calls the step once per microbatch with a stand-in that returns the stage's
output (for a decoder: the model's output class with its own loss). What it logs is averaged over microbatches and
replayed on every rank (so ``sync_dist`` collectives match), and the loss returned to Lightning is the microbatch
mean, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from cuboid.compat import is_view_of
from cuboid.pipeline import decoder, decoder_call
from cuboid.pipeline.results import LogRecorder, ResultExchange, StepResults
from cuboid.pipeline.stages import MULTI_STAGE, SCHEDULES, PipelineError, split_batch
from cuboid.step import plain


class _Captured(Exception):  # noqa: N818  (control flow, not an error)
    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args_, self.kwargs_ = args, kwargs


class _StandIn(nn.Module):
    """Takes the model's place during a pipelined step; other attributes come from the real model."""

    def __init__(self, real: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)


class _CaptureInput(_StandIn):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)


class _StageOutput(_StandIn):
    """The last stage's output, once per microbatch; a second call in one step is refused."""

    def __init__(self, real: nn.Module, output: Any, hook: str, owner: str, make: Callable[..., Any] | None) -> None:
        super().__init__(real)
        object.__setattr__(self, "_output", output)
        object.__setattr__(self, "_where", (hook, owner))
        object.__setattr__(self, "_make", make)
        object.__setattr__(self, "_calls", 0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        calls = object.__getattribute__(self, "_calls") + 1
        object.__setattr__(self, "_calls", calls)
        if calls > 1:
            hook, owner = object.__getattribute__(self, "_where")
            raise PipelineError(
                f"{hook} calls self.{owner}(...) {calls} times in one step; under pipeline parallelism each "
                "microbatch runs through the stages once, so the step must call the model exactly once. Compute "
                "everything from that one output (or run the other call with pipeline_parallel=1)."
            )
        output, make = object.__getattribute__(self, "_output"), object.__getattribute__(self, "_make")
        return output if make is None else make(output, args, kwargs)


def _zero_loss(output: Any) -> torch.Tensor:
    """0 times the sum of the output's floating tensors: a loss on the output's graph (every input gets a
    gradient's metadata) that touches no user code."""
    parts = []

    def add(t: torch.Tensor) -> None:
        if t.is_floating_point():  # a DTensor (loss parallel's logits) by its local shard: beside a plain tensor
            parts.append((t.to_local() if isinstance(t, DTensor) else t).float().sum())  # (the aux loss), mixing

    apply_to_collection(output, torch.Tensor, add)
    return torch.stack(parts).sum() * 0.0


class PipelineRunner:
    """Runs a LightningModule step through a ``torch.distributed.pipelining`` schedule.

    ``shape``: the model is a Hugging Face decoder cut by :mod:`cuboid.pipeline.decoder` (None: a model written for
    Cuboid's pipeline contract, which takes positional tensors). ``carries_aux``: such a model's stages send their
    blocks' ``aux_loss()`` along (:func:`cuboid.pipeline.stages.find_pipeline_split`)."""

    def __init__(
        self,
        stages: list[PipelineStage],
        schedule_name: str,
        microbatches: int,
        owner_name: str,
        pp_group: dist.ProcessGroup,
        last_stage_rank: int,
        host_group: dist.ProcessGroup | None = None,
        shape: decoder.DecoderShape | None = None,
        carries_aux: bool = False,
        context: Any = None,
    ) -> None:
        self.stages, self.microbatches, self.owner_name = stages, microbatches, owner_name
        self.pp_group, self.last_stage_rank = pp_group, last_stage_rank
        self.host_group = host_group if host_group is not None else pp_group
        self.shape = shape
        self.carries_aux = carries_aux  # the last stage's output is (output, the blocks' aux_loss() total)
        self.results = ResultExchange(pp_group, self.host_group, last_stage_rank, stages[0].device)
        cls = SCHEDULES[schedule_name]
        target = stages if schedule_name in MULTI_STAGE else stages[0]
        self.schedule = cls(target, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=True)
        self._step_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
        self.has_first = any(s.is_first for s in stages)
        self._checked: set[str] = set()  # hooks whose first step checked that the model is called as it must be
        self.has_last = any(s.is_last for s in stages)
        # context parallel's runtime where cp > 1 (a cuboid.context.ContextParallel): it cuts each sequence
        self.context = context if getattr(context, "enabled", False) else None

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        assert self._step_loss is not None
        return self._step_loss(output, target)

    def run(
        self,
        lm: Any,
        hook: str,
        batch: Any,
        batch_idx: int,
        train: bool,
        loss_scale: float = 1.0,
        outputs: bool = False,
    ) -> Any:
        """One pipelined step of ``lm.<hook>``; returns the microbatch-mean loss as a device tensor, the same on every
        rank of the pp group (None if the hook returns none). Reads nothing from the device. With ``outputs``
        (``predict_step``), returns instead what the hook returned for the whole batch, its microbatches' outputs
        joined, on every rank of the pp group (:meth:`ResultExchange.share`)."""
        mbs = split_batch(batch, self.microbatches)
        user_step = getattr(lm, hook)
        results = StepResults()  # per microbatch index: its loss and log calls

        real = getattr(lm, self.owner_name)

        def call_user(mb: Any, standin: nn.Module, recorder: LogRecorder) -> Any:
            setattr(lm, self.owner_name, standin)
            lm.__dict__["log"], lm.__dict__["log_dict"] = recorder.log, recorder.log_dict
            try:
                return user_step(mb, batch_idx)
            finally:
                setattr(lm, self.owner_name, real)
                del lm.__dict__["log"], lm.__dict__["log_dict"]

        make_output: Callable[..., Any] | None = None
        stage_kwargs: dict[str, torch.Tensor] = {}
        inputs: tuple = ()
        problem: str | None = None
        cp, tokens = self.context is not None, None
        try:
            if self.shape is not None:  # every stage needs the call's keyword tensors
                plan = decoder_call.bind_call(
                    real, *self._capture(call_user, batch, hook, real, lm), hook, self.owner_name
                )
                inputs, stage_kwargs, tokens = (plan.first_input,), plan.stage_kwargs, plan.first_input
                predicted, microbatches = plan.predicted_tokens(), self.microbatches

                def make_output(output: Any, args: tuple, kwargs: dict) -> Any:
                    return decoder_call.microbatch_output(real, output, args, kwargs, predicted, microbatches)

            elif self.has_first or cp:  # under cp every stage needs the tokens' global positions
                inputs = self._positional_input(*self._capture(call_user, batch, hook, real, lm), hook)
                tokens = inputs[0] if inputs else None
            if self.carries_aux:

                def make_output(output: Any, args: tuple, kwargs: dict) -> Any:
                    return output[0]

            if cp and tokens is not None:
                inputs, stage_kwargs = self.context.pipeline_inputs(inputs, stage_kwargs, tokens, self.microbatches)
            # Contiguous: torch 2.11's stages check each input's strides against the shapes they inferred (a
            # ``batch[:, :-1]`` slice has its parent's row stride); a no-op for inputs that already are.
            inputs = (
                tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in inputs) if self.has_first else ()
            )
            stage_kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in stage_kwargs.items()}
        except (PipelineError, decoder.DecoderSplitError, ValueError) as err:
            problem = str(err)
        if hook not in self._checked:
            # Every stage must stop, not only the first (the others would wait forever). Checked on the first step
            # of each hook only: how a step calls the model does not change, and the check is an object collective.
            box_problem = [problem]
            dist.broadcast_object_list(box_problem, src=dist.get_global_rank(self.pp_group, 0), group=self.host_group)
            if box_problem[0] is not None:
                raise PipelineError(box_problem[0])
            self._checked.add(hook)
        elif problem is not None:
            raise PipelineError(problem)

        def step_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            if not is_view_of(target, targets):
                # The schedule's metadata inference (first step), on uninitialized inputs: the user's step must not
                # run (its metrics would count a garbage microbatch); a zero loss on the output's graph will do.
                return _zero_loss(output)
            recorder = LogRecorder(lm)
            index = target.tolist()[0]  # a host tensor (the microbatch's index): no device read
            standin = _StageOutput(real, output, hook, self.owner_name, make_output)
            if self.carries_aux:  # the step's self.model.aux_loss(): this microbatch's total over every stage
                total = output[1].reshape(())
                object.__setattr__(standin, "aux_loss", lambda: total)
            out = call_user(mbs[index], standin, recorder)
            if outputs:  # predictions, not a loss
                results.outputs[index] = apply_to_collection(out, DTensor, plain)  # (loss parallel's logits)
                return _zero_loss(output)
            loss = out["loss"] if isinstance(out, dict) else out
            results.calls[index] = recorder.calls
            if loss is None:
                results.losses[index] = None
                device = output[0].device if isinstance(output, tuple) else output.device
                return torch.zeros((), device=device, requires_grad=train)
            results.losses[index] = loss.detach()
            return loss * loss_scale

        counts_before = self.results.update_counts(lm) if self.has_last else None
        self._step_loss = step_loss
        # The microbatches' indices, split by the schedule and read by step_loss: host memory on purpose.
        targets = torch.arange(self.microbatches, device="cpu") if self.has_last else None
        run = self.schedule.step if train else self.schedule.eval
        try:
            run(*inputs, target=targets, **stage_kwargs)
        finally:
            self._step_loss = None
        loss = self.results.exchange(lm, results if self.has_last else None, counts_before)
        return self.results.share(results.joined_outputs() if self.has_last else None) if outputs else loss

    def _capture(self, call_user: Callable, batch: Any, hook: str, real: nn.Module, lm: Any) -> tuple[tuple, dict]:
        """How ``hook`` calls the model on the whole batch: its positional and keyword arguments."""
        try:
            call_user(batch, _CaptureInput(real), LogRecorder(lm))
        except _Captured as captured:
            return captured.args_, captured.kwargs_
        raise PipelineError(
            f"{hook} never calls self.{self.owner_name}(...), so Cuboid cannot find the pipeline's input. Under "
            f"pipeline parallelism the step must call the model once, e.g. `out = self.{self.owner_name}(x)`."
        )

    def _positional_input(self, args: tuple, kwargs: dict, hook: str) -> tuple:
        if kwargs:
            raise PipelineError(
                f"{hook} calls self.{self.owner_name}(...) with keyword arguments; a model written for Cuboid's "
                "pipeline contract takes positional tensors only (a Hugging Face decoder takes its own keywords)."
            )
        return args
