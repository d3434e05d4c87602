"""Module buffers kept identical across the data-parallel ranks, as DDP's ``broadcast_buffers`` keeps them.

DDP broadcasts rank 0's buffers (BatchNorm's running statistics, any counter a module keeps) at every forward, so
every rank validates and saves the same model. :class:`BufferBroadcast` does the same over Cuboid's data-parallel
group. By default it sends only what a step changed: torch counts in-place changes of every tensor on the host
(:func:`cuboid.compat.tensor_version`), and when any buffer of a module changed, all of that module's buffers are
sent (BatchNorm's kernel updates its running statistics without counting, but counts ``num_batches_tracked``).
A step that changed no buffer (a Llama's rotary tables) issues no collective; one that did sends those buffers in
one broadcast per dtype. Every rank runs the same code on the same buffers, so every rank finds the same set
changed. A buffer changed behind torch's counter (through ``.data``) in a module with no other counted change is
missed: ``broadcast_buffers="all"`` sends every buffer at every step, as DDP does.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from cuboid import compat


class BufferBroadcast:
    """Broadcast module buffers from the group's first rank before each step and save (:meth:`sync`).

    Args:
        mode: ``True``: the buffers of every module a step changed a buffer of; ``"all"``: every buffer, every
            step (DDP's traffic); ``False``: none (each rank keeps its own; validation may then differ from DDP's).
    """

    def __init__(self, mode: bool | Literal["all"] = True) -> None:
        if mode not in (True, False, "all"):
            raise ValueError(f"broadcast_buffers={mode!r}: choose True (changed buffers), 'all' or False.")
        self.mode = mode
        self._modules: list[list[torch.Tensor]] = []  # each module's own plain buffers
        self._versions: list[list[int]] = []
        self._group: dist.ProcessGroup | None = None
        self._src = 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its process group (the running job's)."""
        return {**vars(self), "_group": None}

    def setup(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        """Watch the plain (not DTensor, not meta) buffers of ``module``'s submodules; ``group``'s first rank is the
        source."""
        self._group = group
        self._src = dist.get_global_rank(group, 0)
        seen: set[int] = set()
        self._modules = []
        for sub in module.modules():
            own = []
            for buf in sub.buffers(recurse=False):
                if id(buf) not in seen and not isinstance(buf, DTensor) and not buf.is_meta:
                    seen.add(id(buf))
                    own.append(buf)
            if own:
                self._modules.append(own)
        self._versions = [[compat.tensor_version(b) for b in own] for own in self._modules]

    @property
    def active(self) -> bool:
        """Whether :meth:`sync` can send anything (on, and more than one rank in the group)."""
        return bool(self.mode) and self._group is not None and dist.get_world_size(self._group) > 1

    def sync(self) -> int:
        """Broadcast the buffers to send (see the class); return how many were sent. Reads no device value."""
        if not self.active:
            return 0
        changed = [
            i
            for i, own in enumerate(self._modules)
            if self.mode == "all"
            or any(compat.tensor_version(b) != v for b, v in zip(own, self._versions[i], strict=True))
        ]
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for i in changed:
            for buf in self._modules[i]:
                by_kind.setdefault((buf.dtype, buf.device), []).append(buf)
        sent = 0
        for bufs in by_kind.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            dist.broadcast(flat, src=self._src, group=self._group)
            offset = 0
            for buf in bufs:
                buf.copy_(flat[offset : offset + buf.numel()].view_as(buf))
                offset += buf.numel()
            sent += len(bufs)
        for i in changed:
            self._versions[i] = [compat.tensor_version(b) for b in self._modules[i]]
        return sent
