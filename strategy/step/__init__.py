"""The training step: the numerics of one training step across the mesh. Precision (FSDP2's mixed-precision
policy), the global gradient norm and clipping, the non-finite guard, and loss parallel."""

from cuboid.step.grad_norm import clip_grad_norm_, global_grad_norm
from cuboid.step.loss_parallel import LossParallel, plain, plain_output
from cuboid.step.nonfinite import NonFiniteError, NonFiniteGuard
from cuboid.step.precision import CuboidPrecision, PrecisionPolicy

__all__ = [
    "CuboidPrecision",
    "LossParallel",
    "NonFiniteError",
    "NonFiniteGuard",
    "PrecisionPolicy",
    "clip_grad_norm_",
    "global_grad_norm",
    "plain",
    "plain_output",
]
