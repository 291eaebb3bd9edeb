"""The chain DP finds the optimum of its own model: checked against brute force.

Chains are drawn with requirements in fine units (``scale`` of them per grid
unit, so the per-cell rounding is exercised), gradients left behind by each
stage, and stages drawn from a small pool so that runs of identical stages
occur and the shared cells of :mod:`gradckpt.planning.solving.dp_cells` are exercised.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradckpt.planning.solving.brute import ReferenceDP, all_schedules, brute_force, evaluate
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.dp_chain import (
    NESTED,
    TOP,
    Chain,
    Option,
    SegmentStep,
    Stage,
    UnitStep,
)

sizes = st.integers(min_value=0, max_value=6)
times = st.integers(min_value=1, max_value=20).map(float)


@st.composite
def options(draw, scale):
    def fine(top):
        return draw(st.integers(min_value=0, max_value=top * scale))

    return Option(
        name="opt",
        kept=draw(sizes),
        fwd=fine(6),
        fwd_nested=fine(6),
        bwd=fine(9),
        time=draw(times),
    )


@st.composite
def stages(draw, scale):
    return Stage(
        input=draw(sizes),
        options=tuple(draw(st.lists(options(scale), min_size=1, max_size=3))),
        none=draw(st.integers(min_value=0, max_value=6 * scale)),
        none_nested=draw(st.integers(min_value=0, max_value=6 * scale)),
        fwd_time=draw(times),
        joins_previous=True,
        grad=draw(st.integers(min_value=0, max_value=2 * scale)),
    )


@st.composite
def chains(draw, max_stages=4, capacity=30):
    """Stages drawn from a pool of at most three, so identical runs are common."""
    scale = draw(st.integers(min_value=1, max_value=3))
    pool = draw(st.lists(stages(scale), min_size=1, max_size=2))
    # Near-twins: one field changed, so a cell keyed too loosely would be shared wrongly.
    field = draw(st.sampled_from(["input", "none", "none_nested", "fwd_time", "grad", "option"]))
    base = pool[0]
    if field == "option":
        twin = replace(base, options=(replace(base.options[0], bwd=base.options[0].bwd + 1),
                                      *base.options[1:]))  # fmt: skip
    elif field == "fwd_time":
        twin = replace(base, fwd_time=base.fwd_time + 1.0)
    else:
        twin = replace(base, **{field: getattr(base, field) + 1})
    pool.append(twin)
    n = draw(st.integers(min_value=1, max_value=max_stages))
    picked = [pool[draw(st.integers(min_value=0, max_value=len(pool) - 1))] for _ in range(n)]
    joins = [i > 0 and draw(st.integers(0, 3)) > 0 for i in range(n)]
    chain = tuple(
        replace(s, input=s.input if i else 0, joins_previous=j)
        for i, (s, j) in enumerate(zip(picked, joins))
    )
    return Chain(chain, capacity=capacity, scale=scale)


@settings(max_examples=150, deadline=None)
@given(chains())
def test_dp_matches_brute_force_at_every_budget(chain):
    dp = ChainDP(chain)
    for m in range(chain.capacity + 1):
        best, _ = brute_force(chain, m)
        assert math.isclose(dp.best_time(m), best) or dp.best_time(m) == best == math.inf
        if math.isfinite(best):
            need, time = evaluate(chain, dp.schedule(m))
            assert need <= m
            assert math.isclose(time, best)


@settings(max_examples=60, deadline=None)
@given(chains(max_stages=5))
def test_least_feasible_is_the_smallest_need(chain):
    dp = ChainDP(chain)
    needs = [evaluate(chain, tree)[0] for tree in all_schedules(chain)]
    least = min(needs)
    assert dp.least_feasible() == (least if least <= chain.capacity else None)


@settings(max_examples=60, deadline=None)
@given(chains(max_stages=9, capacity=40))
def test_dp_equals_the_plain_reference_dp_on_longer_chains(chain):
    fast, reference = ChainDP(chain), ReferenceDP(chain)
    assert fast.least_feasible() == reference.least_feasible()
    for m in range(chain.capacity + 1):
        want = reference.best_time(m)
        assert math.isclose(fast.best_time(m), want) or fast.best_time(m) == want == math.inf
        if math.isfinite(want):
            assert fast.schedule(m) == reference.schedule(m)
            need, time = evaluate(chain, fast.schedule(m))
            assert need <= m and math.isclose(time, want)


def test_identical_blocks_share_their_nested_cells():
    # Twelve identical joinable stages: the nested cells a..b are one per length.
    chain = Chain(tuple(_stage(i > 0) for i in range(12)), capacity=80)
    dp = ChainDP(chain)
    assert dp._cells.cells == 11  # lengths 0..10 (no nested cell ends at the last stage)
    reference = ReferenceDP(chain)
    for m in range(chain.capacity + 1):
        assert dp.best_time(m) == reference.best_time(m)


@pytest.mark.parametrize(
    "change",
    [
        {"fwd_time": 2.0},
        {"none_nested": 4},
        {"grad": 1},
        {"input": 3},
        {"options": (Option("keep", 5, 2, 2, 7, 1.0), Option("recompute", 0, 2, 2, 8, 1.5))},
    ],
)
def test_a_block_that_differs_in_one_field_is_not_shared(change):
    # Ten identical blocks, one of them changed: cells starting or ending at it are
    # their own; sharing them with the others' would change the answer somewhere.
    stages = [_stage(i > 0) for i in range(10)]
    stages[3] = replace(stages[3], **change)
    chain = Chain(tuple(stages), capacity=70)
    fast, reference = ChainDP(chain), ReferenceDP(chain)
    for m in range(chain.capacity + 1):
        assert fast.best_time(m) == reference.best_time(m) or math.isclose(
            fast.best_time(m), reference.best_time(m)
        )
        if math.isfinite(reference.best_time(m)):
            assert fast.schedule(m) == reference.schedule(m)


def test_long_chains_with_segments_equal_the_reference():
    # Longer than one chunk of segment rows (dp_cells._CHUNK), with inputs large
    # enough that segments win at low budgets, and a few odd stages in the run.
    rng = random.Random(11)
    stages = []
    for i in range(40):
        odd = rng.random() < 0.15
        keep = Option("keep", kept=3 + odd, fwd=2, fwd_nested=3, bwd=4 + odd, time=1.0)
        ckpt = Option("recompute", kept=0, fwd=2, fwd_nested=3, bwd=5, time=1.4 + 0.1 * odd)
        stages.append(Stage(2 if i else 0, (keep, ckpt), none=2, none_nested=3,
                            fwd_time=0.4, joins_previous=i > 0, grad=rng.randint(0, 1)))  # fmt: skip
    chain = Chain(tuple(stages), capacity=45)
    fast, reference = ChainDP(chain), ReferenceDP(chain)
    segments = 0
    for m in range(chain.capacity + 1):
        assert fast.best_time(m) == reference.best_time(m) or math.isclose(
            fast.best_time(m), reference.best_time(m)
        )
        if math.isfinite(reference.best_time(m)):
            tree = fast.schedule(m)
            assert tree == reference.schedule(m)
            segments += any(isinstance(node, SegmentStep) for node in tree)
    assert segments > 0  # the segment rows were exercised, not only the stage-alone ones


def test_requirements_below_zero_fit_from_the_first_budget():
    # A calibrated requirement can be negative (the model holds more than the step
    # did there); such segments fit from m = 0 and the fast DP must agree with the
    # reference at every budget, in chunks of segment rows too.
    stages = [replace(_stage(i > 0, none=-3 - i % 2), input=0 if i == 0 else 2) for i in range(40)]
    chain = Chain(tuple(stages), capacity=50)
    fast, reference = ChainDP(chain), ReferenceDP(chain)
    assert fast.least_feasible() == reference.least_feasible()
    for m in range(chain.capacity + 1):
        want = reference.best_time(m)
        assert fast.best_time(m) == want or math.isclose(fast.best_time(m), want)
        if math.isfinite(want):
            assert fast.schedule(m) == reference.schedule(m)


def _stage(joins: bool, none: int = 1) -> Stage:
    option = Option("keep", kept=5, fwd=2, fwd_nested=2, bwd=6, time=1.0)
    ckpt = Option("recompute", kept=0, fwd=2, fwd_nested=2, bwd=8, time=1.5)
    return Stage(1, (option, ckpt), none=none, none_nested=none, fwd_time=0.5, joins_previous=joins)


def test_segments_reach_below_every_stage_checkpointed():
    chain = Chain(tuple(_stage(i > 0) for i in range(6)), capacity=60)
    dp = ChainDP(chain)
    every = [UnitStep(i, 1) for i in range(6)]
    need_every, _ = evaluate(chain, every)
    least = dp.least_feasible()
    assert least is not None and least < need_every
    assert any(isinstance(node, SegmentStep) for node in dp.schedule(least))


def test_no_segment_across_stages_that_do_not_chain():
    chain = Chain(tuple(_stage(False) for i in range(5)), capacity=60)
    dp = ChainDP(chain)
    for m in range(dp.least_feasible(), chain.capacity + 1):
        assert all(isinstance(node, UnitStep) for node in dp.schedule(m))


def test_contexts_are_distinct_tables():
    chain = Chain((_stage(False), _stage(True), _stage(True)), capacity=40)
    dp = ChainDP(chain)
    assert TOP != NESTED
    assert math.isfinite(dp.best_time(40))
