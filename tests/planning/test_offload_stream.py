"""Streamed offload on the zoo: the simulator against the run, and what streaming buys.

Host-copy backend (CPU): moved bytes leave torch's allocator, so the allocator's
peak is the device peak and the backend's count is the host's.
"""

from __future__ import annotations

import pytest

from gradckpt.planning import simulate
from gradckpt.planning.kinds.offload.stream import streamed_storages
from gradckpt.planning.plans.offload_options import OffloadOptions

from .conftest import ZOO_NAMES, assert_same_step
from .test_offload_plan import _offload_blocks, _run_applied

STREAM = OffloadOptions(min_bytes=1024, stream=True)


@pytest.mark.parametrize("name", ZOO_NAMES)
@pytest.mark.parametrize("prefetch", [True, False])
def test_streamed_blocks_match_the_plain_step_and_the_prediction(zoo, name, prefetch):
    ex, prof, plain = zoo.get(name)
    options = OffloadOptions(min_bytes=1024, stream=True, prefetch=prefetch)
    plan = _offload_blocks(prof, options)
    pred = simulate(prof, plan)
    step, session = _run_applied(ex, plan)
    assert_same_step(plain, step)  # bit-equal loss, gradients and buffers (dropout on)
    assert step.peak <= pred.peak_bytes  # at the allocator
    assert step.peak >= 0.99 * pred.peak_bytes
    assert session.backend.peak_host_bytes == pred.host_bytes > 0
    assert session.backend.host_bytes == 0  # all handed back after backward
    loads = [why for kind, _, why in session.events if kind == "load"]
    moved = [m for m in streamed_storages(prof, plan, options) if not m.output]
    assert len(loads) == len(moved)  # each moved storage comes back once
    assert set(loads) <= ({"demand", "prefetch"} if prefetch else {"demand"})


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_streaming_never_holds_more_than_grouped_offload(zoo, name):
    _, prof, _ = zoo.get(name)
    grouped = simulate(prof, _offload_blocks(prof, OffloadOptions(min_bytes=1024)))
    streamed = simulate(prof, _offload_blocks(prof, STREAM))
    assert streamed.peak_bytes <= grouped.peak_bytes
    # Every moved byte waits out in full: streaming costs at least the copies out.
    assert streamed.step_time > prof.step_time
