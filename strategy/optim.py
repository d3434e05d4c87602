"""Optimizers across shards (``cuboid.optim``).

- :class:`Muon`: torch's ``torch.optim.Muon`` with its Newton-Schulz iteration's dtype as an argument
  (``ns_dtype=torch.float32`` for a run compared to one process), each matrix orthogonalized whole.
- :func:`whole_matrices`: a Muon-style optimizer's per-matrix function run on whole matrices when its argument is
  sharded (one gather to the rank whose turn it is, one scatter back).
- :func:`newton_schulz`: the iteration itself (torch's, in any dtype).

Under ``CuboidStrategy`` (both doors), torch's own ``torch.optim.Muon`` orthogonalizes whole matrices as well.
``docs/performance.md`` has the cost beside AdamW; ``cuboid.step.muon`` the details.
"""

from cuboid.step import Muon, MuonError, newton_schulz, whole_matrices

__all__ = ["Muon", "MuonError", "newton_schulz", "whole_matrices"]
