"""Fabric's precision plugin for Cuboid: FSDP2's mixed precision, and the step's context around each forward.

Fabric calls its precision plugin around every forward of a set-up module (``forward_context``, then
``convert_output``) and for ``fabric.backward``. :class:`FabricPrecision` keeps the Trainer plugin's precision
settings (:class:`cuboid.step.precision.PrecisionPolicy`) and runs each forward inside the strategy's step
context (context parallel cuts the inputs and spans attention over the cp ranks; an MoE's load-balancing
statistic is summed over the ranks), then makes the output whole again over the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.fabric.plugins.precision import Precision
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from cuboid.step import PrecisionPolicy


class FabricPrecision(PrecisionPolicy, Precision):
    """The precision plugin of :class:`cuboid.fabric.CuboidStrategy`: ``"32-true"``, ``"bf16-mixed"`` (FSDP2
    gathers bf16 copies, reduces in fp32) or ``"bf16-true"``. No autocast, no loss scaling."""

    def __init__(
        self,
        precision: str = "32-true",
        device_mesh: DeviceMesh | None = None,
        flattened_dims: Mapping[str, tuple[str, ...]] | None = None,
        *,
        step_context: Callable[[], AbstractContextManager] = nullcontext,
        whole_output: Callable[[Any], Any] = lambda output: output,
    ) -> None:
        """``step_context``: the strategy's context around each forward; ``whole_output``: the output made whole
        again over the sequence (context parallel's gather); both the strategy's, handed in."""
        super().__init__(precision, device_mesh, flattened_dims)
        self.step_context = step_context
        self.whole_output = whole_output

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.step_context()

    @override
    def convert_output(self, data: Any) -> Any:
        return self.whole_output(data)
