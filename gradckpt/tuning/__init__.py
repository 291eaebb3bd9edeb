"""Tuning: the micro-batch size and the plan that train fastest in a budget (``gradckpt.tune``).

Sits above planning and apply (it plans every candidate and runs the best few),
beside the verbs of :mod:`gradckpt.api`.

Example:
    >>> from gradckpt.tuning import sliced_loss
    >>> result = gradckpt.tune(model, sliced_loss(model, batch), "auto", global_batch=32)
"""

from gradckpt.tuning.batches import sliced_loss
from gradckpt.tuning.result import TuneCandidate, TuneResult
from gradckpt.tuning.tune import tune

__all__ = ["TuneCandidate", "TuneResult", "sliced_loss", "tune"]
