"""What a pipelined step hands from its last stage to every pp rank, without a host sync or an object collective.

Under pipeline parallel the user's step runs (once per microbatch) on the last stage only, yet every rank must
return the same loss to Lightning, make the same ``self.log`` calls (``sync_dist`` all-reduces must match, and
``callback_metrics`` must agree for checkpoint callbacks) and see the same torchmetrics states. Per step:

1. a small header (host memory, over a gloo group: no device involved) with the index of the step's *structure*
   (the names, arguments and kinds of the values it logged), whether it returned a loss, and which metrics it
   updated (with their update counts);
2. only the first time a structure is seen, the structure itself as an object broadcast (a step that logs every
   ``log_every_n_steps`` has two: with and without its logs);
3. the logged Python numbers, if any, in one host tensor;
4. the loss and the logged tensors in one device tensor broadcast, kept on the device and logged as tensors;
5. the states of the metrics the step updated (tensor broadcasts; a list state's shapes in an object broadcast,
   its tensors broadcast on the device, so that each lands on the receiving rank's device).

Nothing is read from the device: a quiet step (one that logs nothing) costs one gloo header and one scalar
broadcast. Logged values are the mean over microbatches, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from cuboid.compat import set_metric_update_count
from cuboid.step import plain

try:
    from torchmetrics import Metric
except ImportError:  # torchmetrics is optional
    Metric = None  # type: ignore[assignment,misc]

DEVICE, HOST, METRIC = "device", "host", "metric"


class LogRecorder:
    """Stands in for ``LightningModule.log``/``log_dict`` while a step runs on a subset of ranks."""

    def __init__(self, lm: nn.Module) -> None:
        self.calls: list[tuple[str, str, Any, dict]] = []
        self._lm = lm
        self._device = getattr(lm, "device", None)

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        value = plain(value)  # a DTensor (loss parallel's sharded logits' statistics) as a plain tensor
        if Metric is not None and isinstance(value, Metric):
            path = next((n for n, m in self._lm.named_modules() if m is value), None)
            if path is None:
                raise ValueError(f"self.log({name!r}, metric): the metric must be an attribute of the LightningModule")
            self.calls.append((name, METRIC, path, kwargs))
        elif isinstance(value, Tensor) and value.device == self._device:
            self.calls.append((name, DEVICE, value.detach(), kwargs))
        else:  # a Python number (or a host tensor beside a device model): read on the host, as Lightning would
            self.calls.append((name, HOST, float(value), kwargs))

    def log_dict(self, dictionary: dict, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)


@dataclass
class StepResults:
    """What the last stage's step produced: per microbatch, its loss (a detached tensor, or None) and log calls;
    for ``predict_step``, what it returned."""

    losses: dict[int, Tensor | None] = field(default_factory=dict)
    calls: dict[int, list[tuple[str, str, Any, dict]]] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)

    def joined_outputs(self) -> Any:
        """The microbatches' outputs as the whole batch's (:func:`join`)."""
        return join([self.outputs[i] for i in sorted(self.outputs)]) if self.outputs else None


def join(parts: list[Any]) -> Any:
    """Microbatches' outputs as one batch's: tensors joined along their first dimension (0-d ones stacked), lists
    concatenated (their items are the batch's samples, in order), dicts and tuples of the same keys or length joined
    place by place, anything else listed per microbatch."""
    first = parts[0]
    if all(isinstance(p, Tensor) for p in parts):
        return torch.cat(parts) if first.dim() else torch.stack(parts)
    if all(type(p) is list for p in parts):
        return [item for p in parts for item in p]
    if isinstance(first, dict) and all(isinstance(p, dict) and p.keys() == first.keys() for p in parts):
        joined = {k: join([p[k] for p in parts]) for k in first}
        return type(first)(**joined) if is_dataclass(first) else type(first)(joined)  # (transformers' outputs)
    if isinstance(first, tuple) and all(type(p) is type(first) and len(p) == len(first) for p in parts):
        joined = [join(list(column)) for column in zip(*parts, strict=True)]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    return list(parts)


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a shared output: its shape and dtype (the values follow in a broadcast)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _structure(calls: list[tuple[str, str, Any, dict]]) -> list[tuple[str, str, Any, dict]]:
    """Names in first-call order with their kind, metric path and arguments (values left out)."""
    seen: dict[str, tuple[str, str, Any, dict]] = {}
    for name, kind, value, kwargs in calls:
        if name not in seen:
            seen[name] = (name, kind, value if kind == METRIC else None, kwargs)
    return list(seen.values())


class ResultExchange:
    """Sends one pipelined step's loss, logs and metric states from the last stage to every rank of its pp group.

    ``host_group`` is a gloo group over the same ranks as ``group`` (the same group when the backend is gloo).
    """

    def __init__(self, group: dist.ProcessGroup, host_group: dist.ProcessGroup, src: int, device: torch.device):
        self.group, self.host_group, self.src, self.device = group, host_group, src, device
        self.is_src = dist.get_rank() == src
        self.structure: list[tuple[str, str, Any, dict]] = []
        self.known: list[list[tuple[str, str, Any, dict]]] = [[]]  # every structure seen, by index
        self.metrics: list[Any] | None = None

    def _metrics(self, lm: nn.Module) -> list[Any]:
        if self.metrics is None:
            self.metrics = [m for m in lm.modules() if Metric is not None and isinstance(m, Metric)]
        return self.metrics

    def update_counts(self, lm: nn.Module) -> list[int]:
        """Each metric's update count (the last stage compares them before and after its step)."""
        return [m.update_count for m in self._metrics(lm)]

    def exchange(self, lm: Any, results: StepResults | None, counts_before: list[int] | None) -> Tensor | None:
        """On every rank of the pp group: replay the step's logs, copy updated metric states, return the loss."""
        metrics = self._metrics(lm)
        n = len(metrics)
        header = torch.zeros(2 + 2 * n, dtype=torch.int64, device="cpu")  # host memory, over gloo: on purpose
        grouped: dict[str, list[Any]] = {}
        structure = self.structure
        if self.is_src:
            assert results is not None and counts_before is not None
            calls = [c for i in sorted(results.calls) for c in results.calls[i]]
            for name, kind, value, _ in calls:
                if kind != METRIC:
                    grouped.setdefault(name, []).append(value)
            structure = _structure(calls)
            index = next((i for i, known in enumerate(self.known) if known == structure), len(self.known))
            losses = [loss for loss in results.losses.values() if loss is not None]
            has_loss = bool(losses)
            counts = self.update_counts(lm)
            dirty = [int(a != b) for a, b in zip(counts, counts_before, strict=True)]
            header = torch.tensor([index, int(has_loss), *dirty, *counts], dtype=torch.int64, device="cpu")
        dist.broadcast(header, src=self.src, group=self.host_group)
        values = header.tolist()  # host memory: no device sync
        index, has_loss, dirty, counts = values[0], values[1], values[2 : 2 + n], values[2 + n :]
        if index == len(self.known):  # the first step that logs these names (and kinds, and arguments)
            box = [structure]
            dist.broadcast_object_list(box, src=self.src, group=self.host_group)
            self.known.append(box[0])
        self.structure = self.known[index]
        host_names = [name for name, kind, _, _ in self.structure if kind == HOST]
        device_names = [name for name, kind, _, _ in self.structure if kind == DEVICE]

        host = torch.zeros(len(host_names), dtype=torch.float64, device="cpu")
        flat = torch.zeros(has_loss + len(device_names), dtype=torch.float32, device=self.device)
        if self.is_src:
            if host_names:
                host = torch.tensor(
                    [sum(grouped[k]) / len(grouped[k]) for k in host_names], dtype=torch.float64, device="cpu"
                )
            parts = []
            if has_loss:
                parts.append(torch.stack([loss.float() for loss in losses]).mean())
            parts += [torch.stack([v.float() for v in grouped[k]]).mean() for k in device_names]
            if parts:
                flat = torch.stack(parts)
        if host_names:
            dist.broadcast(host, src=self.src, group=self.host_group)
        if flat.numel():
            dist.broadcast(flat, src=self.src, group=self.group)
        self._sync_metrics(metrics, dirty, counts)
        self._replay(lm, flat[has_loss:], host.tolist())
        return flat[0] if has_loss else None

    def share(self, outputs: Any) -> Any:
        """``outputs`` (the last stage's, None elsewhere) on every rank of the pp group: their structure, shapes,
        dtypes and non-tensor values in one object broadcast over the host group, each tensor in a broadcast of its
        own over the pp group (on the device). For ``predict_step``, whose outputs vary in shape from batch to batch
        (the last batch), not for the training step."""
        box: list[Any] = [None]
        if self.is_src:
            box = [apply_to_collection(outputs, Tensor, lambda t: _Slot(tuple(t.shape), t.dtype))]
        dist.broadcast_object_list(box, src=self.src, group=self.host_group)
        if self.is_src:
            shared = apply_to_collection(outputs, Tensor, lambda t: t.to(self.device))
        else:
            shared = apply_to_collection(
                box[0], _Slot, lambda s: torch.empty(s.shape, dtype=s.dtype, device=self.device)
            )
        tensors: list[Tensor] = []
        apply_to_collection(shared, Tensor, tensors.append)
        for tensor in tensors:
            dist.broadcast(tensor, src=self.src, group=self.group)
        return shared

    def _replay(self, lm: Any, device_values: Tensor, host_values: list[float]) -> None:
        devices, hosts = iter(device_values), iter(host_values)
        for name, kind, path, kwargs in self.structure:
            if kind == METRIC:
                lm.log(name, lm.get_submodule(path), **kwargs)
            else:
                lm.log(name, next(devices) if kind == DEVICE else next(hosts), **kwargs)

    def _sync_metrics(self, metrics: list[Any], dirty: list[int], counts: list[int]) -> None:
        """Copy the states of the metrics the last stage's step updated to every pp rank."""
        for metric, changed, count in zip(metrics, dirty, counts, strict=True):
            if not changed:
                continue
            for name in metric.metric_state:
                value = getattr(metric, name)
                if isinstance(value, Tensor):
                    dist.broadcast(value, src=self.src, group=self.group)
                else:  # a list state (a concatenating metric): its shapes go as an object, its tensors on the device
                    setattr(metric, name, self.share(value if self.is_src else None))  # (a pickled tensor would
                    # unpickle on the sender's device: cuda:0 of another node, not this rank's)
            if not self.is_src:
                set_metric_update_count(metric, count)
