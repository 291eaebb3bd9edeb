"""Every frontier point is a budget plan() reaches: the peak is not monotone in the DP's budget."""

from __future__ import annotations

import gradckpt
from gradckpt.testing import make


def test_plan_reaches_every_frontier_point():
    # On this U-Net the frontier's leanest point came from a DP budget above the least
    # feasible one, which plan() did not try: it refused that budget in about 2 of 3
    # processes (which schedules tie depends on the op times measured); now it scans.
    ex = make("unet", depth=3, base=8, image=64, batch=2)
    planner = gradckpt.Planner(gradckpt.profile(ex.model, ex.loss_fn, repeats=1))
    for point in planner.frontier():
        plan = planner.plan(point.peak_bytes)
        assert plan.predicted_peak_bytes <= point.peak_bytes
