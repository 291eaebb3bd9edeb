"""Keep, recompute or offload chosen jointly by the chain DP: checked against brute force."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gradckpt.planning.kinds.offload.solve import host_bytes_of, solve_chain_priced
from gradckpt.planning.solving.brute import all_schedules, brute_force, evaluate
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.dp_chain import Chain, Option, Stage, UnitStep
from gradckpt.profiling.records import NEVER


@st.composite
def three_choice_stage(draw, scale):
    """A stage with keep, recompute and offload options shaped like real ones."""
    fine = lambda top: draw(st.integers(0, top * scale))  # noqa: E731
    base = draw(st.integers(1, 10)) * 1.0
    kept = draw(st.integers(1, 6))
    fwd, bwd = fine(6), fine(8)
    keep = Option("keep", kept, fwd, fine(6), bwd, base)
    recompute = Option("recompute", 0, fine(6), fine(6), bwd + fine(3), base + draw(st.integers(1, 8)))
    offload = Option(
        "offload",
        draw(st.integers(0, kept - 1)),  # holds less than keep
        fwd + fine(2),  # the stash holds the previous group a little longer
        NEVER,  # never inside a segment's recompute
        bwd + fine(3),  # the prefetched reload is live during the backward
        base + draw(st.integers(0, 6)),  # the stall the link leaves
    )
    return Stage(
        input=draw(st.integers(0, 4)),
        options=(keep, recompute, offload),
        none=fine(6),
        none_nested=fine(6),
        fwd_time=base,
        joins_previous=True,
        grad=fine(2),
    )


@st.composite
def chains(draw, max_stages=4, capacity=28):
    scale = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_stages))
    stages = [draw(three_choice_stage(scale)) for _ in range(n)]
    stages[0] = Stage(0, *[getattr(stages[0], f) for f in
                           ("options", "none", "none_nested", "fwd_time", "joins_previous", "grad")])  # fmt: skip
    return Chain(tuple(stages), capacity=capacity, scale=scale)


def _nodes(tree, nested=False):
    for node in tree:
        if isinstance(node, UnitStep):
            yield node, nested
        else:
            yield from _nodes(node.schedule, True)


def _assert_dp_is_brute_force(chain) -> None:
    """At every budget: the DP's time is brute force's, and its schedule fits and takes it."""
    dp = ChainDP(chain)
    for m in range(chain.capacity + 1):
        best, tree = brute_force(chain, m)
        assert dp.best_time(m) == best, f"m={m}"
        if tree is not None:
            need, seconds = evaluate(chain, dp.schedule(m))
            assert need <= m and seconds == best


@settings(max_examples=120, deadline=None)
@given(chains())
def test_dp_with_three_choices_equals_brute_force_at_every_budget(chain):
    _assert_dp_is_brute_force(chain)


@settings(max_examples=60, deadline=None)
@given(chains())
def test_offload_is_never_chosen_inside_a_segment(chain):
    dp = ChainDP(chain)
    for m in range(chain.capacity + 1):
        if dp.best_time(m) == float("inf"):
            continue
        for node, nested in _nodes(dp.schedule(m)):
            assert not (nested and node.option == 2)


def _host(chain: Chain, per_stage: list[int]) -> list[list[int]]:
    return [[0, 0, h] for h in per_stage][: len(chain.stages)]


@settings(max_examples=60, deadline=None)
@given(chains(max_stages=4), st.lists(st.integers(1, 9), min_size=4, max_size=4), st.integers(0, 20))
def test_host_budget_by_pricing_is_feasible_and_no_better_than_brute_force(chain, sizes, limit):
    host = _host(chain, sizes)
    for m in (chain.capacity // 2, chain.capacity):
        fitting = [
            (evaluate(chain, t)[1], t) for t in all_schedules(chain)
            if evaluate(chain, t)[0] <= m and host_bytes_of(t, host) <= limit
        ]  # fmt: skip
        found = solve_chain_priced(chain, host, m, limit)
        if found is None:
            # Pricing gives up only when nothing fits even with offload priced out.
            assert not [f for f in fitting if host_bytes_of(f[1], host) == 0]
            continue
        tree, seconds = found
        need, check = evaluate(chain, tree)
        assert need <= m and check == seconds
        assert host_bytes_of(tree, host) <= limit
        assert seconds >= min(s for s, _ in fitting)


@settings(max_examples=60, deadline=None)
@given(chains(max_stages=4), st.lists(st.integers(1, 9), min_size=4, max_size=4))
def test_a_host_budget_that_does_not_bind_changes_nothing(chain, sizes):
    host = _host(chain, sizes)
    m = chain.capacity
    best, _ = brute_force(chain, m)
    found = solve_chain_priced(chain, host, m, sum(sizes))
    if best == float("inf"):
        assert found is None
    else:
        assert found is not None and found[1] == best


def test_offload_wins_when_recompute_is_dear_and_the_link_is_hidden():
    keep = Option("keep", 10, 5, 5, 5, 1.0)
    recompute = Option("recompute", 0, 5, 5, 5, 3.0)
    offload = Option("offload", 0, 5, NEVER, 5, 1.1)
    stage = Stage(0, (keep, recompute, offload), 5, 5, 1.0, False)
    chain = Chain((stage, stage, stage), capacity=40)
    dp = ChainDP(chain)
    tree = dp.schedule(12)
    # The last stage's kept bytes are never held under another stage's run: it keeps.
    assert [node.option for node in tree] == [2, 2, 0]
    assert dp.best_time(12) == brute_force(chain, 12)[0] == 1.1 + 1.1 + 1.0
    # With the host holding only one stage's worth, one offloads and one recomputes.
    tree, seconds = solve_chain_priced(chain, [[0, 0, 1]] * 3, 12, 1)
    # (Identical stages: a single price would switch both at once; the pricing breaks ties.)
    assert sorted(node.option for node in tree) == [0, 1, 2]
    assert seconds == 1.1 + 3.0 + 1.0


@st.composite
def four_choice_stage(draw, scale):
    """Keep, recompute, offload, and recompute with its input offloaded (``kept`` < 0:
    the stage frees its input between its forward and backward)."""
    stage = draw(three_choice_stage(scale))
    fine = lambda top: draw(st.integers(0, top * scale))  # noqa: E731
    recompute = stage.options[1]
    boundary = Option(
        "recompute_offload",
        -stage.input,  # its input leaves the device
        recompute.fwd + fine(2),  # the stash holds the previous input a little longer
        NEVER,  # never inside a segment's recompute
        recompute.bwd + fine(3),  # the prefetched input is live during the backward
        recompute.time + draw(st.integers(0, 4)),  # the stall the link leaves
    )
    return Stage(stage.input, (*stage.options, boundary), stage.none, stage.none_nested,
                 stage.fwd_time, stage.joins_previous, stage.grad)  # fmt: skip


@st.composite
def four_choice_chains(draw, max_stages=4):
    scale = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_stages))
    stages = [draw(four_choice_stage(scale)) for _ in range(n)]
    first = stages[0]
    boundary = replace(first.options[3], kept=0)  # the chain's own input: none to free
    stages[0] = Stage(0, (*first.options[:3], boundary), first.none, first.none_nested,
                      first.fwd_time, first.joins_previous, first.grad)  # fmt: skip
    # Above every schedule's need: the tables are flat there, as in real chains (whose
    # capacity is above the plain schedule's), so reading past the grid is exact.
    return Chain(tuple(stages), capacity=64, scale=scale)


@settings(max_examples=60, deadline=None)
@given(four_choice_chains())
def test_dp_with_offloaded_inputs_equals_brute_force_at_every_budget(chain):
    _assert_dp_is_brute_force(chain)
