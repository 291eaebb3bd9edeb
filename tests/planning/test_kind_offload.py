"""The Offload kind's handler: what it offers the DP, what it holds, costs and installs."""

from __future__ import annotations

import pytest

import gradckpt
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.planning import Plan, UnitChoice
from gradckpt.planning.handlers.lookup import build_lookup
from gradckpt.planning.handlers.registry import handler_for
from gradckpt.planning.kinds.keep import KeepHandler
from gradckpt.planning.kinds.offload.handler import OFFLOAD
from gradckpt.planning.kinds.offload.sim import moved_storages, stage_stall
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.solving.chain import build_chain
from gradckpt.profiling.records import NEVER

OPTIONS = OffloadOptions(min_bytes=1024, d2h_bandwidth=1e9, h2d_bandwidth=2e9)


@pytest.fixture
def gpt(zoo):
    _, prof, _ = zoo.get("gpt")
    units = tuple(u for u in prof.units if u.plannable)
    return prof, units


def test_offered_to_blocks_only_and_only_with_offload_options(gpt):
    prof, units = gpt
    handler = handler_for(OFFLOAD)
    plain_look = build_lookup(prof, units)
    look = build_lookup(prof, units, {gradckpt.Offload: OPTIONS})
    for u in units:
        assert handler.stage_options(prof, u, plain_look) == []
        assert handler.stage_options(prof, u, look) == ([OFFLOAD] if u.is_block else [])


def test_holds_what_keep_holds_less_what_it_moves(gpt):
    prof, units = gpt
    look = build_lookup(prof, units, {gradckpt.Offload: OPTIONS})
    block = next(u for u in units if u.is_block)
    keep = KeepHandler().kept_storages(prof, block, gradckpt.Keep(), look)
    held = handler_for(OFFLOAD).kept_storages(prof, block, OFFLOAD, look)
    moved = set(moved_storages(prof, block, OPTIONS.min_bytes))
    assert moved and held == keep - moved
    assert all(prof.storages[s].nbytes >= OPTIONS.min_bytes for s in moved)


def test_its_time_is_the_stall_and_it_is_never_nested(gpt):
    prof, units = gpt
    model = build_chain(prof, settings={gradckpt.Offload: OPTIONS})
    for u, options, stage in zip(model.units, model.options, model.chain.stages):
        if not u.is_block:
            assert OFFLOAD not in options
            continue
        k = options.index(OFFLOAD)
        assert k == 2  # third on every block: the calibration runs an all-offload plan
        stall = stage_stall(prof, units, units.index(u), moved_storages(prof, u, 1024), OPTIONS)
        assert stage.options[k].time == pytest.approx(u.fwd_time + u.bwd_time + stall)
        assert stage.options[k].fwd_nested == NEVER
        assert stage.options[k].kept < stage.options[0].kept


def test_install_makes_one_runtime_from_the_plans_options(gpt):
    prof, units = gpt
    plan = Plan(tuple(UnitChoice(u.path, OFFLOAD if u.is_block else gradckpt.Keep())
                      for u in units), prof.fingerprint,
                offload=OffloadOptions(min_bytes=77, prefetch=False, host_budget=123))  # fmt: skip
    runtime = handler_for(OFFLOAD).install(plan)
    assert isinstance(runtime, OffloadRuntime)
    assert (runtime.min_bytes, runtime.prefetch, runtime.host_budget) == (77, False, 123)


def test_applied_units_share_one_runtime_and_summary_reads_offload(zoo):
    ex, prof, _ = zoo.get("gpt")
    units = [u for u in prof.units if u.plannable]
    plan = Plan(tuple(UnitChoice(u.path, OFFLOAD if u.is_block else gradckpt.Keep())
                      for u in units), prof.fingerprint)  # fmt: skip
    gradckpt.apply(ex.model, plan)
    try:
        from gradckpt.apply.apply import applied_units

        runtimes = {id(s.runtime) for s in applied_units(ex.model).values()
                    if s.decision == OFFLOAD}  # fmt: skip
        assert len(runtimes) == 1
    finally:
        gradckpt.remove(ex.model)
    assert "blocks.0                     offload" in plan.summary()
