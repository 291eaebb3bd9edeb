"""The DP's tie (issue #31): schedules that near-equal times do not decide.

Two fresh profiles of one model price the same plans a hair apart: sums of the
same terms in another order (float rounding), and op times measured afresh. The
strict minimum then picks whichever is a hair cheaper, and the plan changes from
run to run. With a tie, each choice takes the first candidate in a fixed order
within what is left of the tie, so the whole schedule gives up at most the tie.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gradckpt.planning.solving.brute import ReferenceDP, evaluate
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.dp_chain import Chain, Option, Stage, UnitStep

from .test_dp import chains


@settings(max_examples=120, deadline=None)
@given(chains(), st.sampled_from([0.0, 0.5, 2.0, 7.0]))
def test_a_tied_schedule_fits_and_gives_up_at_most_the_tie(chain, tie):
    dp, reference = ChainDP(chain), ReferenceDP(chain)
    for m in range(chain.capacity + 1):
        best = dp.best_time(m)
        if not math.isfinite(best):
            continue
        tree = dp.schedule(m, tie=tie)
        need, seconds = evaluate(chain, tree)
        assert need <= m
        assert best - 1e-9 <= seconds <= best + tie + 1e-9
        assert tree == reference.schedule(m, tie=tie)  # the same rule, written plainly


def _stage(*times: float, input: int = 1) -> Stage:
    options = tuple(Option(f"o{k}", kept=1, fwd=1, fwd_nested=1, bwd=1, time=t)
                    for k, t in enumerate(times))  # fmt: skip
    return Stage(input=input, options=options, none=1, none_nested=1, fwd_time=1.0,
                 joins_previous=False)  # fmt: skip


def _options(tree) -> list[int]:
    return [step.option for step in tree if isinstance(step, UnitStep)]


def test_a_float_rounding_difference_is_no_win():
    # The second option is cheaper by one unit in the last place: the strict minimum
    # takes it; with a tie, even of zero, the first stands.
    chain = Chain((_stage(1.0, math.nextafter(1.0, 0.0), input=0),), capacity=10)
    dp = ChainDP(chain)
    assert _options(dp.schedule(10)) == [1]
    assert _options(dp.schedule(10, tie=0.0)) == [0]


def test_the_tie_is_spent_once_over_all_choices():
    # Two stages, each with a second option 1 ms cheaper than its first.
    chain = Chain((_stage(1.0, 0.999, input=0), _stage(1.0, 0.999)), capacity=10)
    dp = ChainDP(chain)
    assert _options(dp.schedule(10, tie=0.0)) == [1, 1]  # beyond the tie: the faster
    assert _options(dp.schedule(10, tie=0.0025)) == [0, 0]  # both within it
    # 1.5 ms of tie: the first choice spends 1 ms of it, the second cannot.
    assert _options(dp.schedule(10, tie=0.0015)) == [0, 1]


@settings(max_examples=80, deadline=None)
@given(chains(), st.sampled_from([0.0, 1.0, 3.0, 10.0]))
def test_the_leanest_schedule_within_a_tie_is_the_least_budget_that_fast(chain, tie):
    dp, reference = ChainDP(chain), ReferenceDP(chain)
    for m in range(chain.capacity + 1):
        lean = dp.leanest_within(m, tie)
        assert lean == reference.leanest_within(m, tie)
        if not math.isfinite(dp.best_time(m)):
            assert lean == m
            continue
        assert lean <= m and dp.best_time(lean) <= dp.best_time(m) + tie
        assert lean == 0 or dp.best_time(lean - 1) > dp.best_time(m) + tie
        need, _ = evaluate(chain, dp.schedule(lean, tie=0.0))
        assert need <= lean  # it holds no more than the budget it was found at


@settings(max_examples=80, deadline=None)
@given(chains(), st.sampled_from([0.0, 1.0, 3.0, 10.0]))
def test_the_levels_within_a_tie_are_each_faster_time_leanest_first(chain, tie):
    dp, reference = ChainDP(chain), ReferenceDP(chain)
    for m in range(chain.capacity + 1):
        levels = dp.levels_within(m, tie)
        assert levels == reference.levels_within(m, tie)
        if not math.isfinite(dp.best_time(m)):
            assert levels == []
            continue
        own = dp.best_time(m)
        times = [dp.best_time(k) for k in levels]
        if levels:
            assert levels[0] == dp.leanest_within(m, tie)
        assert levels == sorted(levels) and all(k < m for k in levels)
        assert all(own < t <= own + tie for t in times)
        assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
        # Each is the least budget of its time: one unit less is slower.
        assert all(k == 0 or dp.best_time(k - 1) > dp.best_time(k) for k in levels)
