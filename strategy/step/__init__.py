"""The training step: the numerics of one training step across the mesh. Precision (FSDP2's mixed-precision
policy), the reductions deferred while gradients accumulate, the global gradient norm and clipping, the non-finite guard, loss parallel, and the first step's check
that tensor parallel's whole parameters get the same gradient on every tp rank, and Muon on whole matrices."""

from cuboid.step.accumulation import DeferMode, DeferredReductions
from cuboid.step.grad_norm import clip_grad_norm_, global_grad_norm
from cuboid.step.loss_parallel import LossParallel, plain, plain_output
from cuboid.step.muon import (
    Muon,
    MuonError,
    muon_groups,
    newton_schulz,
    refuse_muon_shapes,
    whole_matrices,
    whole_matrix_steps,
)
from cuboid.step.nonfinite import NonFiniteError, NonFiniteGuard
from cuboid.step.precision import CuboidPrecision, PrecisionPolicy
from cuboid.step.tp_gradients import TpGradients, TpGradientsDiffer, check_tp_gradients

__all__ = [
    "CuboidPrecision",
    "DeferMode",
    "DeferredReductions",
    "LossParallel",
    "Muon",
    "MuonError",
    "NonFiniteError",
    "NonFiniteGuard",
    "PrecisionPolicy",
    "TpGradients",
    "TpGradientsDiffer",
    "check_tp_gradients",
    "clip_grad_norm_",
    "global_grad_norm",
    "muon_groups",
    "newton_schulz",
    "plain",
    "plain_output",
    "refuse_muon_shapes",
    "whole_matrices",
    "whole_matrix_steps",
]
