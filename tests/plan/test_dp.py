"""The chain DP finds the optimum of its own model: checked against brute force."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gradckpt.plan.brute import all_schedules, brute_force, evaluate
from gradckpt.plan.dp import NESTED, TOP, Chain, ChainDP, Option, Stage

sizes = st.integers(min_value=0, max_value=6)
times = st.integers(min_value=1, max_value=20).map(float)


@st.composite
def options(draw):
    return Option(
        name="opt",
        kept=draw(sizes),
        fwd=draw(sizes),
        fwd_nested=draw(sizes),
        bwd=draw(st.integers(min_value=0, max_value=9)),
        time=draw(times),
    )


@st.composite
def chains(draw, max_stages=4):
    n = draw(st.integers(min_value=1, max_value=max_stages))
    stages = tuple(
        Stage(
            input=draw(sizes) if i else 0,
            options=tuple(draw(st.lists(options(), min_size=1, max_size=3))),
            none=draw(sizes),
            none_nested=draw(sizes),
            fwd_time=draw(times),
            joins_previous=i > 0 and draw(st.booleans()),
        )
        for i in range(n)
    )
    return Chain(stages, capacity=30)


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


def _stage(joins: bool, none: int = 1) -> Stage:
    option = Option("keep", kept=5, fwd=2, fwd_nested=2, bwd=6, time=1.0)
    ckpt = Option("recompute", kept=0, fwd=2, fwd_nested=2, bwd=8, time=1.5)
    return Stage(1, (option, ckpt), none=none, none_nested=none, fwd_time=0.5, joins_previous=joins)


def test_segments_reach_below_every_stage_checkpointed():
    chain = Chain(tuple(_stage(i > 0) for i in range(6)), capacity=60)
    dp = ChainDP(chain)
    every = [("unit", i, 1) for i in range(6)]
    need_every, _ = evaluate(chain, every)
    least = dp.least_feasible()
    assert least is not None and least < need_every
    assert any(node[0] == "segment" for node in dp.schedule(least))


def test_no_segment_across_stages_that_do_not_chain():
    chain = Chain(tuple(_stage(False) for i in range(5)), capacity=60)
    dp = ChainDP(chain)
    for m in range(dp.least_feasible(), chain.capacity + 1):
        assert all(node[0] == "unit" for node in dp.schedule(m))


def test_contexts_are_distinct_tables():
    chain = Chain((_stage(False), _stage(True), _stage(True)), capacity=40)
    dp = ChainDP(chain)
    assert TOP != NESTED
    assert math.isfinite(dp.best_time(40))
