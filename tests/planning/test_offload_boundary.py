"""``RecomputeOffload`` on the zoo: a recomputed block's kept input moved to host and back.

Host-copy backend (CPU): the moved bytes leave torch's allocator, so the
allocator's peak is the device peak and the backend's count the host's. Each
plan is checked at the allocator against the simulator's prediction, the host
bytes against the predicted ones, and the gradients bit for bit against the
plain step (dropout on, same seed).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import gradckpt
from gradckpt.apply.apply import applied_units
from gradckpt.engine.decisions import Offload, RecomputeOffload
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.planning import Plan, UnitChoice, simulate
from gradckpt.planning.kinds.offload.boundary import offloadable_boundary
from gradckpt.planning.kinds.offload.sim import offload_effect
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.profiling.records import NEVER

from .conftest import assert_same_step, run_step

OPTIONS = OffloadOptions(min_bytes=1024)


def _plan(prof, decide, options=OPTIONS) -> Plan:
    """Blocks as ``decide(unit)`` says, every other unit kept."""
    items = tuple(
        UnitChoice(u.path, decide(u) if u.is_block else gradckpt.Keep())
        for u in prof.units if u.plannable
    )  # fmt: skip
    return Plan(items, prof.fingerprint, offload=options)


def _boundary(u):
    return RecomputeOffload(u.chain_arg)


def _run(ex, plan):
    gradckpt.apply(ex.model, plan)
    try:
        step = run_step(ex)
        sessions = {id(s.runtime.session): s.runtime.session for s in
                    applied_units(ex.model).values() if isinstance(s.runtime, OffloadRuntime)}  # fmt: skip
    finally:
        gradckpt.remove(ex.model)
    (session,) = sessions.values()  # one session for both offloading kinds
    return step, session


@pytest.mark.parametrize("prefetch", [True, False])
def test_offloaded_boundaries_are_exact_and_as_predicted(zoo, prefetch):
    ex, prof, plain = zoo.get("gpt")
    options = OffloadOptions(min_bytes=1024, prefetch=prefetch)
    plan = _plan(prof, _boundary, options)
    pred = simulate(prof, plan)
    step, session = _run(ex, plan)
    assert_same_step(plain, step)  # bit-equal loss, gradients, buffers (dropout on)
    assert step.peak == pred.peak_bytes  # at the allocator, to the byte
    blocks = [u for u in prof.units if u.is_block]
    inputs = sum(prof.storages[u.chain_input].nbytes for u in blocks)
    assert session.backend.peak_host_bytes == pred.host_bytes == inputs
    assert session.backend.host_bytes == 0  # all handed back after backward
    # Each input comes back before its block's recompute (the last one never left).
    loads = [e for e in session.events if e[0] == "load"]
    assert loads[0] == ("load", blocks[-1].path, "still held")
    assert [e[2] for e in loads[1:]] == ["prefetch" if prefetch else "demand"] * (len(blocks) - 1)


def test_moving_the_boundaries_lowers_the_allocator_peak_below_recompute(zoo):
    ex, prof, _ = zoo.get("gpt")
    recompute = _plan(prof, lambda u: gradckpt.Recompute())
    moved = _plan(prof, _boundary)
    assert simulate(prof, moved).peak_bytes < simulate(prof, recompute).peak_bytes
    assert _run(ex, moved)[0].peak < run_step_applied(ex, recompute).peak


def run_step_applied(ex, plan):
    gradckpt.apply(ex.model, plan)
    try:
        return run_step(ex)
    finally:
        gradckpt.remove(ex.model)


def test_boundaries_and_offloaded_blocks_share_one_stash(zoo):
    ex, prof, plain = zoo.get("gpt")
    plan = _plan(prof, lambda u: _boundary(u) if u.index % 2 else Offload())
    pred = simulate(prof, plan)
    step, session = _run(ex, plan)
    assert_same_step(plain, step)
    assert step.peak == pred.peak_bytes
    assert session.backend.peak_host_bytes == pred.host_bytes
    stores = [e[1] for e in session.events if e[0] == "store"]
    assert stores == [u.path for u in prof.units if u.is_block]  # forward order, one queue
    effect = offload_effect(prof, plan, plan.offload)
    assert [m.boundary for m in effect.units] == [
        isinstance(i.decision, RecomputeOffload) for i in plan.items if
        isinstance(i.decision, (Offload, RecomputeOffload))
    ]  # fmt: skip


def test_a_boundary_inside_a_segment_runs_as_recompute(zoo):
    ex, prof, plain = zoo.get("gpt")
    blocks = [u for u in prof.units if u.plannable and u.is_block]
    inner = tuple(UnitChoice(u.path, _boundary(u)) for u in blocks[:2])
    items = []
    for u in prof.units:
        if not u.plannable or u.path == blocks[1].path:
            continue
        if u.path == blocks[0].path:
            items.append(gradckpt.Segment(inner))
        else:
            items.append(UnitChoice(u.path, gradckpt.Keep()))
    plan = Plan(tuple(items), prof.fingerprint, offload=OPTIONS)
    pred = simulate(prof, plan)
    assert pred.host_bytes == 0
    step = run_step_applied(ex, plan)
    assert_same_step(plain, step)
    assert step.peak == pred.peak_bytes


def test_the_profile_says_which_boundaries_free_memory(zoo):
    _, prof, _ = zoo.get("gpt")
    blocks = [u for u in prof.units if u.is_block]
    assert all(offloadable_boundary(prof, u, 1024) == u.chain_input for u in blocks)
    # Too small to be worth a transfer:
    big = prof.storages[blocks[0].chain_input].nbytes + 1
    assert offloadable_boundary(prof, blocks[0], big) is None
    # Saved by code outside the block (glue code saving it for its own backward): moving
    # it would free nothing, so it is not offered.
    sid = blocks[1].chain_input
    own = next(p for p in prof.packs if p.storage == sid and p.unit == blocks[1].index)
    packs = tuple(replace(p, unit=-1) if p is own else p for p in prof.packs)
    assert offloadable_boundary(replace(prof, packs=packs), blocks[1], 1024) is None
    # Returned by the forward (alive at its end): likewise.
    storages = tuple(replace(s, natural_free=NEVER) if s.id == sid else s for s in prof.storages)
    assert offloadable_boundary(replace(prof, storages=storages), blocks[1], 1024) is None


def test_boundary_plan_round_trips_json(zoo, tmp_path):
    _, prof, _ = zoo.get("gpt")
    plan = _plan(prof, lambda u: RecomputeOffload(3) if u.index == 3 else _boundary(u))
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded == plan
    assert loaded.units[3].decision == RecomputeOffload(3)


def test_a_decision_naming_another_argument_is_refused_clearly(zoo):
    ex, prof, _ = zoo.get("gpt")
    plan = _plan(prof, lambda u: RecomputeOffload(u.chain_arg + 1))
    with pytest.raises(ValueError, match="chain input"):
        simulate(prof, plan)
    gradckpt.apply(ex.model, plan)
    try:
        with pytest.raises(ValueError, match=r"plan moves argument 1 of blocks\.0"):
            run_step(ex)
    finally:
        gradckpt.remove(ex.model)
    with pytest.raises(ValueError, match="flat argument position"):
        RecomputeOffload(-1)


def test_summary_and_explain_say_the_input_moves(zoo):
    _, prof, _ = zoo.get("gpt")
    plan = _plan(prof, _boundary)
    text = plan.summary()
    assert "blocks.1                     recompute  input to host after its forward" in text
    assert "offload: 4 unit(s) to host memory over 25 GB/s" in text
    explanation = gradckpt.explain(prof, plan=plan)
    moved = {r.why for r in explanation.rows if r.status == "offloaded"}
    assert "input of recomputed blocks.1 to host after blocks.1's forward, back at " \
           "blocks.2's backward" in moved  # fmt: skip
    decisions = {u.path: u.decision for u in explanation.units}
    assert "back at blocks.2 backward" in decisions["blocks.1"]
