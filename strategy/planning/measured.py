"""What one training step of a LightningModule costs, measured on the module itself rather than from its family's
formula: its parameter bytes per module, and one step's activation bytes, backward temporaries, optimizer state and
FLOPs per sample, taken on fake tensors (no storage: a 70B model measures on a laptop).

:func:`profile` copies the module onto the meta device (parameters only as shapes; a module already on meta costs
nothing to copy), gives the copy fake storage, and runs ``training_step`` on the batch, then ``backward`` and the
optimizer's ``step``, under torch's ``FakeTensorMode`` and ``FlopCounterMode`` with ``compat.LiveBytes`` counting
what is alive. The batch stays real (``compat.RealData``): operators on data alone run for real, whatever meets a
weight is fake. The real module, its weights and its Trainer are untouched: the copy's ``self.log`` does nothing
and ``self.trainer`` is the real one, read only.

A step that cannot run on fake tensors (it reads a value: ``.item()``, a data-dependent shape; a custom autograd
function without a meta kernel; manual optimization) gives an :class:`Unmeasured` with the reason in one line, and
the caller falls back to the memory-led default.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.flop_counter import FlopCounterMode

from cuboid import compat


@dataclass(frozen=True)
class Unit:
    """One repeated block (an FSDP unit, a checkpointing and pipeline unit): its parameter bytes and what its
    forward leaves for backward, per sample."""

    name: str
    param_bytes: int
    activation_bytes: float  # per sample, what stays alive after the block's forward
    input_bytes: float  # per sample, the block's input (what full checkpointing keeps of it)


@dataclass(frozen=True)
class Profile:
    """One measured training step (the measured batch's figures divided by its samples where "per sample").

    Bytes are in the dtype the step ran in (``compute_bytes`` per element) unless said otherwise."""

    name: str
    samples: int  # in the measured batch
    seq: int | None  # its sequence length (dim 1 of its first integer tensor), if any
    params: int  # elements
    trainable: int  # elements that get gradients and optimizer state
    optimizer_per_trainable: float  # optimizer-state elements per trainable element (AdamW 2, SGD 0 or 1)
    compute_bytes: int  # bytes per element of the measured step's parameters
    units: tuple[Unit, ...]
    activation_bytes: float  # per sample, what autograd keeps at forward's end (the whole model's)
    temp_bytes: float  # per sample, what the step's peak holds beyond that (backward's temporaries, the loss's)
    flops: float  # per sample, forward and backward
    step_temp_bytes: int  # the optimizer step's temporaries beyond its state (for-loop: one parameter's; foreach: all)
    peak_bytes: int  # the single-process step's peak, everything together
    seconds: float  # what measuring took

    @property
    def block_activation_bytes(self) -> float:
        return sum(u.activation_bytes for u in self.units)


@dataclass(frozen=True)
class Unmeasured:
    """Why a module's step could not be measured on fake tensors (one line, said at setup)."""

    reason: str


def _meta_copy(lm: nn.Module) -> nn.Module:
    """``lm`` copied with every parameter and buffer as a meta tensor (no data copied); its Trainer kept."""
    memo: dict[int, Any] = {}
    for module in lm.modules():
        for p in module.parameters(recurse=False):
            memo.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
        for b in module.buffers(recurse=False):
            memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    trainer = getattr(lm, "_trainer", None)
    for module in lm.modules():  # what belongs to the running job is shared, never copied
        for value in vars(module).values():
            if isinstance(value, (DeviceMesh, dist.ProcessGroup)) or value is trainer:
                memo[id(value)] = value
    copied = copy.deepcopy(lm, memo)  # a LightningModule pickles without its Trainer: given back below
    if trainer is not None:
        copied.trainer = trainer
    for name in ("log", "log_dict"):  # the copy's values are fake: never into the run's logger
        object.__setattr__(copied, name, lambda *args, **kwargs: None)
    return copied


def _fake_storage(module: nn.Module, mode: Any, dtype: torch.dtype | None) -> None:
    """Every meta parameter and buffer of ``module`` made a fake CPU tensor (``dtype`` for floating ones),
    shared weights kept shared."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in made:
            kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
            with mode:
                new = torch.empty(t.shape, dtype=kind, device="cpu")
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return made[id(t)]

    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            m.register_parameter(name, fake(p, True))  # the copy's own modules (made by _meta_copy)
        for name, b in list(m.named_buffers(recurse=False)):
            m._buffers[name] = fake(b, False)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a batch (nested in mappings, lists and tuples), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for item in items for t in _tensors(item)]


def batch_samples(batch: Any) -> tuple[int, int | None]:
    """(samples, sequence length) of a batch: dim 0 of its first tensor; dim 1 of its first integer tensor of two
    or more dims (token ids), if any."""
    tensors = _tensors(batch)
    if not tensors:
        raise ValueError("the batch holds no tensor")
    first = tensors[0]
    samples = int(first.shape[0]) if first.dim() else 1
    seq = next((int(t.shape[1]) for t in tensors if t.dim() >= 2 and not t.is_floating_point()), None)
    return samples, seq


def first_batch(data: Any) -> Any:
    """The first batch of the training data (a DataLoader or any iterable; a list or dict of them: the first)."""
    if isinstance(data, Mapping):
        data = next(iter(data.values()))
    elif isinstance(data, (list, tuple)) and data and not isinstance(data[0], torch.Tensor):
        data = data[0]
    return next(iter(data))


def _optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers ``configure_optimizers`` returned, in any of Lightning's forms."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and isinstance(configured[0], (list, tuple)):
            return _optimizers(configured[0])  # ([optimizers], [schedulers])
        return [o for item in configured for o in _optimizers(item)]
    return []


def _loss(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        return out.get("loss")
    return None


def profile(
    lm: nn.Module,
    batch: Any,
    blocks: list[tuple[str, nn.Module]] | None = None,
    dtype: torch.dtype | None = None,
    foreach: bool | None = None,
) -> Profile | Unmeasured:
    """One training step of ``lm`` (a LightningModule) on ``batch``, with fake weights, measured.

    ``blocks``: the repeated units (``cuboid.parallel.find_blocks``'s answer, looked up when None). ``dtype``: the
    floating dtype to run in (the compute dtype of the run: bf16 under ``bf16-mixed``); None keeps the module's.
    ``foreach``: how the optimizer's update runs where it left it to torch (``foreach=None``): torch's default on
    the device the run will have (True on GPUs: every parameter's temporaries at once), not on the fake step's CPU."""
    from cuboid.parallel import find_blocks

    start = time.perf_counter()
    if getattr(lm, "automatic_optimization", True) is False:
        return Unmeasured("its training_step steps the optimizer itself (manual optimization)")
    try:
        samples, seq = batch_samples(batch)
        copied = _meta_copy(lm)
        mode = compat.fake_mode()
        _fake_storage(copied, mode, dtype)
        modules = dict(copied.named_modules())
        found = find_blocks(copied) if blocks is None else [(n, modules[n]) for n, _ in blocks]
        optimizers = _optimizers(copied.configure_optimizers())
        for group in (g for opt in optimizers for g in opt.param_groups):
            if foreach is not None and group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = foreach
        params = list(dict.fromkeys(copied.parameters()))
        trainable = [p for p in params if p.requires_grad]
        compute = params[0].element_size() if params else 4
        held = sum(p.numel() * p.element_size() for p in params)
        held += sum(b.numel() * b.element_size() for b in copied.buffers())
        live = compat.LiveBytes(held, [*params, *copied.buffers()], on_peak=lambda: at_peak.update(grads=grads[0]))
        grads = [0]
        at_peak = {"grads": 0}

        def grad_made(p: torch.Tensor) -> None:
            grads[0] += p.numel() * p.element_size()

        per_unit: dict[str, list[float]] = {}
        handles = [p.register_post_accumulate_grad_hook(grad_made) for p in trainable]
        handles += [h for name, m in found for h in _watch(m, live, per_unit, name)]
        try:
            with mode, compat.RealData(), live, FlopCounterMode(display=False) as flops, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = _loss(copied.training_step(batch, 0))  # real data: RealData lets the step read it
                if loss is None:
                    return Unmeasured("its training_step returned no loss (a dict without 'loss', or None)")
                forward_end = live.live
                live.peak = forward_end
                loss.backward()
                backward_peak, grads_at_peak = live.peak, at_peak["grads"]
                before_step = live.peak = live.live  # parameters and every gradient
                for opt in optimizers:  # its state made, and the temporaries of its update (foreach: all at once)
                    opt.step()
                states = live.live - before_step
                step_temps = max(0, live.peak - live.live)
        finally:
            for h in handles:
                h.remove()
    except Exception as err:  # noqa: BLE001  (any failure of the user's step on fake tensors means: not measurable)
        text = str(err).strip()
        first = text.splitlines()[0] if text else type(err).__name__
        where = _user_frame(err)
        return Unmeasured(f"its training step does not run on fake tensors ({type(err).__name__}: {first[:160]})"
                          + (f" at {where}" if where else ""))  # fmt: skip
    n_trainable = sum(p.numel() for p in trainable)
    units = tuple(
        Unit(name, sum(p.numel() for p in m.parameters()) * compute,
             per_unit.get(name, [0.0, 0.0])[0] / samples, per_unit.get(name, [0.0, 0.0])[1] / samples)
        for name, m in found
    )  # fmt: skip
    activations = max(0, forward_end - held)
    working = max(0, backward_peak - held - grads_at_peak)
    return Profile(
        name=type(lm).__name__,
        samples=samples,
        seq=seq,
        params=sum(p.numel() for p in params),
        trainable=n_trainable,
        optimizer_per_trainable=states / max(sum(p.numel() * p.element_size() for p in trainable), 1),
        step_temp_bytes=step_temps,
        compute_bytes=compute,
        units=units,
        activation_bytes=activations / samples,
        temp_bytes=max(0, working - activations) / samples,
        flops=float(flops.get_total_flops()) / samples,
        peak_bytes=backward_peak,
        seconds=time.perf_counter() - start,
    )


def _user_frame(err: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the failure outside torch and Cuboid: the user's line that read a
    value (``loss.item()``) or called what fake tensors cannot run."""
    import os
    import traceback

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(skip)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _watch(module: nn.Module, live: Any, out: dict[str, list[float]], name: str) -> list[Any]:
    """Hooks on one block: the bytes its forward leaves alive, and its input's bytes (first forward only)."""
    before: list[int] = []

    def pre(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        before.append(live.live)
        if name not in out:
            first = next(iter(_tensors((args, kwargs))), None)
            out[name] = [0.0, float(first.numel() * first.element_size()) if first is not None else 0.0]

    def post(_m: nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
        if before:
            out[name][0] += max(0, live.live - before.pop())

    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True)]  # fmt: skip


def describe(p: Profile) -> str:
    """One line: what was measured."""
    gib = 2**30
    return (
        f"{p.name}: {p.params / 1e6:,.1f}M parameters ({p.trainable / 1e6:,.1f}M trained), "
        f"{len(p.units)} blocks; per sample {p.activation_bytes / gib:.3g} GiB of activations, "
        f"{p.flops / 1e9:,.3g} GFLOP (measured on fake tensors in {p.seconds:.2f} s)"
    )


__all__ = ["Profile", "Unit", "Unmeasured", "batch_samples", "describe", "first_batch", "profile"]
