"""The step wing: the numerics of one training step across the mesh. Precision (FSDP2's mixed-precision
policy), the global gradient norm and clipping, the non-finite guard, and loss parallel."""

from cuboid.step.grad_norm import clip_grad_norm_, global_grad_norm
from cuboid.step.nonfinite import NonFiniteError, NonFiniteGuard
from cuboid.step.precision import CuboidPrecision

__all__ = ["CuboidPrecision", "NonFiniteError", "NonFiniteGuard", "clip_grad_norm_", "global_grad_norm"]
