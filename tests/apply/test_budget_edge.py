"""A budget at exactly the peak torch's every-block checkpointing reaches is met.

The simulator's least peak can sit a few hundred bytes above what the allocator
sees (a bias gradient counted before a free at the same op); a budget within
0.1% below it is tried on one real step under the leanest plan, and kept when the
allocator says it fits.
"""

from __future__ import annotations

import pytest

import gradckpt
from gradckpt.testing import make

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fit_at_torchs_every_block_peak_is_met_at_the_allocator(peak_and_grads, every_block_peak):
    ex = make("gpt", layers=4, d_model=64, seq=64, vocab=512)
    budget = every_block_peak(ex)
    with pytest.raises(gradckpt.BudgetError) as predicted:
        gradckpt.plan(ex.model, ex.loss_fn, 1)  # the least peak the simulator predicts
    assert predicted.value.least_peak_bytes <= budget * 1.001  # at most 0.1% above it
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget)
    peak, _ = peak_and_grads(ex.model, ex.loss_fn)
    assert peak <= budget and plan.predicted_peak_bytes == peak
    assert plan.peak_level == "allocator"


def test_a_budget_further_below_the_least_peak_is_still_refused(every_block_peak):
    ex = make("gpt", layers=4, d_model=64, seq=64, vocab=512)
    budget = int(every_block_peak(ex) * 0.99)
    with pytest.raises(gradckpt.BudgetError, match="least peak"):
        gradckpt.fit(ex.model, ex.loss_fn, budget)
    assert gradckpt.applied_plan(ex.model) is None
