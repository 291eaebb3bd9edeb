"""The demo's model, budget and machine give one plan from two fresh profiles (issue #31).

tests/planning/test_costs_stable.py plans twice in one process, where the second
profile reuses the first one's settled times; here everything a process keeps is
dropped in between (op and step times, the block's timings, the engine's costs),
so the second profile measures afresh, as the demo run again in a new process does.
"""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.cli.demo import DEMO_SIZES, LR
from gradckpt.planning.plans.plan import Segment
from gradckpt.profiling import calibration
from gradckpt.testing import make


def _demo_plan(ex, optimizer) -> gradckpt.Plan:
    """What ``gradckpt demo`` plans at its default budget (half the whole step's peak)."""
    calibration.forget()  # as in a new process
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=2, optimizer=optimizer)
    return gradckpt.Planner(prof).plan(0.5)


@pytest.mark.xfail(
    strict=False,
    reason="issue #31, open: with the tie (0.5% of the step) 98 of 98 fresh demo profiles "
    "taken under load plan alike (the main before: 34 of 40), but run as this test under load 4-5 the "
    "pair differed in 3 of 6 runs on 2026-12-03: a segment [drop blocks.0 blocks.1] that "
    "peaks 0.5 MiB lower sits at the tie's edge in time. Op times robust to load are needed.",
)
def test_two_fresh_profiles_of_the_demo_model_plan_the_same_decisions(one_thread):
    ex = make("gpt", seed=0, **DEMO_SIZES)
    optimizer = torch.optim.AdamW(ex.model.parameters(), lr=LR)
    first, second = _demo_plan(ex, optimizer), _demo_plan(ex, optimizer)
    # The budget forces real decisions (segments, or units not kept).
    assert any(isinstance(i, Segment) or i.mode != "keep" for i in first.items)
    assert first.items == second.items, (first.summary(), second.summary())
    calibration.forget()
