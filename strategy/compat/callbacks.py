"""Where Lightning's weight-averaging callbacks keep their whole copy of the model.

``WeightAveraging`` (and ``EMAWeightAveraging``) makes an ``AveragedModel`` of the LightningModule in its
``setup``, kept as ``_average_model``, the copy itself being its ``module``
(lightning/pytorch/callbacks/weight_averaging.py); ``StochasticWeightAveraging`` keeps a ``deepcopy`` of the
LightningModule as ``_average_model`` (lightning/pytorch/callbacks/stochastic_weight_avg.py). Both are made in
the callbacks' ``setup``, before the strategy's. No public attribute names them. Checked on lightning 2.5.0 and
2.6.6; pinned in tests/test_compat.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def averaged_copies(callbacks: Iterable[Any]) -> list[nn.Module]:
    """The whole copies of the LightningModule that ``callbacks``' weight averaging updates (made already)."""
    copies = []
    for callback in callbacks:
        names = {cls.__name__ for cls in type(callback).__mro__}
        held = getattr(callback, "_average_model", None)
        if "WeightAveraging" in names and held is not None:
            copies.append(held.module)
        elif "StochasticWeightAveraging" in names and held is not None:
            copies.append(held)
    return copies
