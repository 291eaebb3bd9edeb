"""The simulator's generic plan-wide effect hook (KindHandler.plan_effect), on toy kinds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gradckpt.engine.decisions import KEEP, Decision, decision_kind, forget_decision_kind
from gradckpt.planning import Plan, UnitChoice, simulate
from gradckpt.planning.handlers.effects import Buffer, StepEffect, combined
from gradckpt.planning.handlers.registry import forget, register
from gradckpt.planning.kinds.keep import KeepHandler
from gradckpt.planning.simulation.simulate import live_trace
from gradckpt.profiling.records import NEVER

BUFFER_BYTES = 3 << 20  # more than anything the zoo's MLP holds, so it shows in the peak


@decision_kind("toy_pinned")
@dataclass(frozen=True)
class Pinned(Decision):
    """Runs as keep; the plan as a whole pins a buffer for the step and waits on a link."""


@decision_kind("toy_released")
@dataclass(frozen=True)
class Released(Decision):
    """Runs as keep, but its saved tensors stop holding their storages (as if moved off)."""


class PinnedHandler(KeepHandler):
    decision = Pinned

    def plan_effect(self, profile, plan):
        return StepEffect(buffers=(Buffer(BUFFER_BYTES, 0, NEVER),), stall=0.25, host_bytes=7)


class ReleasedHandler(KeepHandler):
    decision = Released

    def plan_effect(self, profile, plan):
        paths = {c.path for c in plan.units if isinstance(c.decision, Released)}
        mine = {u.index for u in profile.units if u.path in paths}
        packs = frozenset(p.id for p in profile.packs if p.unit in mine)
        return StepEffect(released_packs=packs, stall=0.5, host_bytes=5)


@pytest.fixture
def toy_kinds():
    for cls in (Pinned, Released):
        decision_kind(cls.kind)(cls)
    register(PinnedHandler())
    register(ReleasedHandler())
    yield
    for cls in (Pinned, Released):
        forget(cls)
        forget_decision_kind(cls.kind)


def _plan(prof, choose) -> Plan:
    units = [u for u in prof.units if u.plannable]
    return Plan(tuple(UnitChoice(u.path, choose(u)) for u in units), prof.fingerprint)


def test_an_effect_s_buffer_stall_and_host_bytes_reach_the_prediction(zoo, toy_kinds):
    _, prof, _ = zoo.get("mlp")
    block = next(u for u in prof.units if u.plannable and u.is_block)
    keep = simulate(prof, _plan(prof, lambda u: KEEP))
    pinned = simulate(prof, _plan(prof, lambda u: Pinned() if u is block else KEEP))
    assert pinned.peak_bytes == keep.peak_bytes + BUFFER_BYTES
    assert pinned.step_time == pytest.approx(keep.step_time + 0.25)
    assert (pinned.offload_stall, pinned.host_bytes) == (0.25, 7)
    assert (keep.offload_stall, keep.host_bytes) == (0.0, 0)


def test_released_saved_tensors_stop_holding_their_storages(zoo, toy_kinds):
    _, prof, _ = zoo.get("mlp")
    keep_pos, keep_live, _ = live_trace(prof, _plan(prof, lambda u: KEEP))
    rel_pos, rel_live, _ = live_trace(prof, _plan(prof, lambda u: Released() if u.is_block else KEEP))
    end = prof.ops[prof.forward_ops - 1].position  # the forward's last op: most is saved then
    at = lambda positions, lives: lives[max(i for i, p in enumerate(positions) if p <= end)]  # noqa: E731
    assert at(rel_pos, rel_live) < at(keep_pos, keep_live)
    assert max(rel_live) <= max(keep_live)


def test_effects_of_several_kinds_combine(zoo, toy_kinds):
    _, prof, _ = zoo.get("mlp")
    blocks = [u for u in prof.units if u.plannable and u.is_block]
    chosen = {blocks[0].path: Pinned(), blocks[1].path: Released()}
    both = simulate(prof, _plan(prof, lambda u: chosen.get(u.path, KEEP)))
    assert both.host_bytes == 12
    assert both.offload_stall == pytest.approx(0.75)


def test_combined_effect_keeps_the_latest_hold_and_every_release():
    a = StepEffect(released_packs=frozenset({1}), live_until={4: 10, 5: 3}, stall=1.0)
    b = StepEffect(released_packs=frozenset({2}), live_until={4: 7}, host_bytes=9,
                   buffers=(Buffer(8, 1, 2),))  # fmt: skip
    c = combined([a, b])
    assert c.released_packs == {1, 2} and dict(c.live_until) == {4: 10, 5: 3}
    assert (c.stall, c.host_bytes, c.buffers) == (1.0, 9, (Buffer(8, 1, 2),))
    assert combined([a]) is a and combined([]) is None
