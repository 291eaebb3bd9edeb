"""The offload cost model as pure functions: transfers, overlap, the copy queue, options."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradckpt.planning.kinds.offload.cost import (
    Compute,
    Issue,
    Wait,
    exposed_seconds,
    run_timeline,
    transfer_seconds,
    unit_stall,
)
from gradckpt.planning.plans.offload_options import OffloadOptions, offload_options

# ------------------------------------------------------------------ transfers


def test_one_gigabyte_at_fifty_gigabytes_per_second_is_twenty_milliseconds():
    assert transfer_seconds(10**9, 1, 50e9, 0.0) == pytest.approx(0.02)


def test_transfer_time_is_linear_in_bytes():
    assert transfer_seconds(2 * 10**9, 1, 25e9, 0.0) == pytest.approx(
        2 * transfer_seconds(10**9, 1, 25e9, 0.0)
    )


def test_fixed_cost_is_per_storage():
    assert transfer_seconds(0, 10, 25e9, 1e-3) == pytest.approx(10e-3)
    assert transfer_seconds(4096, 3, 1e12, 2e-3) == pytest.approx(6e-3 + 4096 / 1e12)


def test_nothing_to_move_costs_nothing():
    assert transfer_seconds(0, 0, 25e9, 1e-3) == 0.0


def test_superchip_link_is_sixteen_times_faster_than_pcie_class():
    slow = transfer_seconds(10**9, 1, 25e9, 0.0)
    fast = transfer_seconds(10**9, 1, 400e9, 0.0)
    assert slow / fast == pytest.approx(16.0)


def test_directions_have_their_own_bandwidth():
    o = OffloadOptions(d2h_bandwidth=170e9, h2d_bandwidth=411e9)  # GH200-like copy engines
    d2h = transfer_seconds(10**9, 1, o.d2h_bandwidth, 0.0)
    h2d = transfer_seconds(10**9, 1, o.h2d_bandwidth, 0.0)
    assert d2h > h2d


# ------------------------------------------------------------------- overlap


def test_exposed_is_what_the_window_cannot_hide():
    assert exposed_seconds(3.0, 2.0) == 1.0
    assert exposed_seconds(1.0, 2.0) == 0.0
    assert exposed_seconds(2.0, 2.0) == 0.0


def test_negative_window_hides_nothing():
    assert exposed_seconds(1.5, -4.0) == 1.5


def test_unit_stall_adds_both_directions():
    assert unit_stall(1.0, 1.0, forward_window=0.5, backward_window=2.0) == 0.5
    assert unit_stall(1.0, 3.0, forward_window=0.5, backward_window=2.0) == 1.5
    assert unit_stall(0.1, 0.1, forward_window=1.0, backward_window=1.0) == 0.0


@given(
    st.floats(0, 10), st.floats(0, 10), st.floats(0, 10), st.floats(0, 10), st.floats(0, 5)
)
def test_unit_stall_never_grows_with_a_longer_window(d2h, h2d, fwd, bwd, more):
    assert unit_stall(d2h, h2d, fwd + more, bwd + more) <= unit_stall(d2h, h2d, fwd, bwd)


@given(st.floats(0, 10), st.floats(0, 10), st.floats(0, 10), st.floats(0, 10))
def test_unit_stall_is_between_zero_and_both_transfers(d2h, h2d, fwd, bwd):
    assert 0.0 <= unit_stall(d2h, h2d, fwd, bwd) <= d2h + h2d + 1e-12


# ------------------------------------------------------------------ timeline


def test_a_transfer_hidden_by_compute_does_not_stall():
    t = run_timeline([Issue("a", 1.0), Compute(2.0), Wait("a")])
    assert t.stall == 0.0
    assert t.end == 2.0


def test_a_transfer_longer_than_compute_stalls_by_the_difference():
    t = run_timeline([Issue("a", 3.0), Compute(2.0), Wait("a")])
    assert t.stall == pytest.approx(1.0)
    assert t.end == pytest.approx(3.0)


def test_one_queue_serialises_transfers():
    t = run_timeline([Issue("a", 2.0), Issue("b", 2.0), Compute(1.0), Wait("b")])
    assert t.finish == {"a": 2.0, "b": 4.0}
    assert t.stall == pytest.approx(3.0)


def test_a_transfer_starts_no_earlier_than_it_is_issued():
    t = run_timeline([Compute(5.0), Issue("a", 1.0), Wait("a")])
    assert t.finish["a"] == 6.0
    assert t.stall == pytest.approx(1.0)


def test_stalls_shift_later_compute():
    t = run_timeline([Issue("a", 2.0), Wait("a"), Issue("b", 1.0), Compute(1.0), Wait("b")])
    assert t.waits == {"a": 2.0, "b": 0.0}
    assert t.end == pytest.approx(3.0)


def test_prefetch_earlier_hides_more():
    late = run_timeline([Compute(1.0), Issue("x", 2.0), Wait("x")])
    early = run_timeline([Issue("x", 2.0), Compute(1.0), Wait("x")])
    assert early.stall < late.stall


def test_waiting_for_a_transfer_never_issued_is_an_error():
    with pytest.raises(ValueError, match="never issued"):
        run_timeline([Wait("ghost")])


def test_issuing_a_key_twice_is_an_error():
    with pytest.raises(ValueError, match="twice"):
        run_timeline([Issue("a", 1.0), Issue("a", 1.0)])


def test_not_a_step_is_a_type_error():
    with pytest.raises(TypeError, match="not a timeline step"):
        run_timeline([3.0])  # type: ignore[list-item]


@given(st.lists(st.floats(0, 5), min_size=1, max_size=8), st.floats(0, 20))
def test_total_stall_is_at_most_the_queue_length(durations, compute):
    steps = [Issue(i, d) for i, d in enumerate(durations)]
    steps += [Compute(compute), *(Wait(i) for i in range(len(durations)))]
    t = run_timeline(steps)
    assert t.stall <= sum(durations) + 1e-9
    assert t.end == pytest.approx(max(compute, sum(durations)))


# ------------------------------------------------------------------- options


def test_offload_option_values():
    assert offload_options(False) is None
    assert offload_options(None) is None
    assert offload_options(True) == OffloadOptions()
    given_options = OffloadOptions(host_budget=1 << 30)
    assert offload_options(given_options) is given_options
    assert offload_options({"min_bytes": 1}).min_bytes == 1


def test_bad_offload_values_say_what_is_accepted():
    with pytest.raises(TypeError, match="OffloadOptions"):
        offload_options("yes")
    with pytest.raises(TypeError, match="fields"):
        offload_options({"bandwidth": 1})


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("d2h_bandwidth", 0, "positive number of bytes per second"),
        ("h2d_bandwidth", -1.0, "positive number of bytes per second"),
        ("h2d_bandwidth", math.nan, "positive number of bytes per second"),
        ("transfer_latency", -1e-3, "seconds >= 0"),
        ("host_budget", -5, "bytes"),
        ("host_budget", 1.5, "bytes"),
        ("min_bytes", 0, "int >= 1"),
    ],
)
def test_bad_options_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=f"{field}.*{words}"):
        OffloadOptions(**{field: value})


def test_options_round_trip_json():
    o = OffloadOptions(d2h_bandwidth=1e9, host_budget=123, min_bytes=7, prefetch=False)
    assert OffloadOptions.from_json(o.to_json()) == o
