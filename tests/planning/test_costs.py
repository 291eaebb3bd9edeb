"""The engine-cost term of the simulator: its counts are the engine's, and it closes the gap."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import gradckpt
from gradckpt.engine import frame as frame_module
from gradckpt.engine import modes
from gradckpt.measure import count_ops
from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.measure.timing import low_estimate
from gradckpt.planning import Plan, UnitChoice, simulate
from gradckpt.planning.handlers.engine_counts import EngineCounts
from gradckpt.planning.simulation.costs import engine_seconds, step_costs, unit_counts
from gradckpt.planning.solving.chain import build_chain, with_engine_costs
from gradckpt.profiling import profile
from gradckpt.testing import make

from .conftest import run_step
from .test_simulate import _shapes

UNIT_COSTS = {
    "regions": EngineCosts(region=1.0),
    "recompute_ops": EngineCosts(lean_op=1.0, recompute_op=1.0),  # every recomputed op
    "mode_ops": EngineCosts(recompute_op=1.0),  # those under the recompute's dispatch mode
    "policy_ops": EngineCosts(policy_op=1.0),
    "saved_tensors": EngineCosts(saved_tensor=1.0),
}


def _predicted_counts(prof, plan) -> dict[str, int]:
    """Each count read off the simulator by giving that event a cost of one second."""
    # No untimed work per op (step time = sum of op times): only the unit costs count.
    prof = dataclasses.replace(prof, step_time=sum(op.time for op in prof.ops))
    base = simulate(dataclasses.replace(prof, engine_costs=EngineCosts()), plan).step_time
    return {
        name: round(simulate(dataclasses.replace(prof, engine_costs=c), plan).step_time - base)
        for name, c in UNIT_COSTS.items()
    }


class _EngineEvents:
    """Counts what the engine really does, by wrapping its dispatch modes, hooks and frames."""

    def __init__(self, monkeypatch) -> None:
        self.counts = dict.fromkeys(UNIT_COSTS, 0)
        counts = self.counts

        def counting(cls, key):
            original = cls.__torch_dispatch__

            def dispatch(self, func, types, args=(), kwargs=None):
                if modes.counts_as_op(func):
                    counts[key] += 1
                    if key == "mode_ops":
                        counts["recompute_ops"] += 1
                return original(self, func, types, args, kwargs)

            monkeypatch.setattr(cls, "__torch_dispatch__", dispatch)

        counting(modes.RecomputeMode, "mode_ops")
        counting(modes.PolicyMode, "policy_ops")
        init, pack_recompute, pack_nested, recompute = (
            frame_module.Frame.__init__,
            frame_module.Frame._pack_recompute,
            frame_module.Frame._pack_nested,
            frame_module.Frame.recompute,
        )

        def counted_recompute(self, gid):
            # A lean recompute runs no mode of ours: count its ops from outside. One
            # under RecomputeMode is counted by it (replayed outputs included).
            if gid in self.recomputed or self._needs_recompute_mode():
                return recompute(self, gid)
            ops = count_ops(recompute, self, gid)
            counts["recompute_ops"] += sum(ops.values())
            return None

        def frame_init(self, *args, **kwargs):
            counts["regions"] += 1
            init(self, *args, **kwargs)

        def recompute_hook(self, gid):
            hook = pack_recompute(self, gid)

            def pack(x):
                counts["saved_tensors"] += 1
                return hook(x)

            return pack

        def nested(self, x):  # a region opened inside a recompute: the pack is the parent's
            counts["saved_tensors"] += 1
            return pack_nested(self, x)

        monkeypatch.setattr(frame_module.Frame, "__init__", frame_init)
        monkeypatch.setattr(frame_module.Frame, "recompute", counted_recompute)
        monkeypatch.setattr(frame_module.Frame, "_pack_recompute", recompute_hook)
        monkeypatch.setattr(frame_module.Frame, "_pack_nested", nested)


@pytest.mark.parametrize("name", ["gpt", "dropout_mlp"])
def test_counts_are_what_the_engine_does(zoo, name, monkeypatch):
    ex, prof, _ = zoo.get(name)
    checked = 0
    for shape, plan in _shapes(prof):
        predicted = _predicted_counts(prof, plan)
        with monkeypatch.context() as patch:
            events = _EngineEvents(patch)
            gradckpt.apply(ex.model, plan)
            try:
                run_step(ex)
            finally:
                gradckpt.remove(ex.model)
        assert predicted == events.counts, f"{name} {shape}"
        checked += 1
    assert checked >= 4


def test_engine_seconds_is_counts_times_costs():
    counts = EngineCounts(regions=2, recompute_ops=10, policy_ops=5, saved_tensors=3, mode_ops=4)
    costs = EngineCosts(
        region=1.0, recompute_op=0.1, policy_op=0.01, saved_tensor=0.001, lean_op=0.0001
    )
    # 6 ops recomputed lean, 4 under the mode.
    assert engine_seconds(counts, costs) == pytest.approx(2 + 0.0006 + 0.4 + 0.05 + 0.003)
    assert engine_seconds(counts + counts, costs) == pytest.approx(2 * 2.4536)


def test_dp_options_carry_the_engine_costs(zoo):
    _, prof, _ = zoo.get("gpt")
    costs = EngineCosts(region=1e-3, recompute_op=1e-4, policy_op=1e-4, saved_tensor=1e-4)
    # A third of the step outside the timed kernels: recomputed ops pay a share of it.
    untimed = 1.5 * sum(op.time for op in prof.ops)
    prof = dataclasses.replace(prof, engine_costs=costs, step_time=untimed)
    assert step_costs(prof).recompute_op > costs.recompute_op
    plain, costed = build_chain(prof), with_engine_costs(build_chain(prof), prof)
    for unit, opts, before, after in zip(
        plain.units, plain.options, plain.chain.stages, costed.chain.stages
    ):
        for option, old, new in zip(opts, before.options, after.options):
            extra = engine_seconds(unit_counts(prof, unit, option), step_costs(prof))
            assert new.time == pytest.approx(old.time + extra)
            assert (extra > 0) == (option != gradckpt.Keep())


def _cpu_step_seconds(ex, rounds: int = 7) -> float:
    def step() -> float:
        ex.model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        start = time.thread_time()
        ex.loss_fn().backward()
        return time.thread_time() - start

    step()
    return low_estimate(step() for _ in range(rounds))


def test_engine_term_closes_the_gap_where_engine_costs_dominate(one_thread):
    """A tiny MLP (width 4): its ops cost little more than their dispatch, so every
    region's engine work is most of the overhead. Measured on thread CPU time
    (least of 7 steps), which other processes on a loaded machine barely move.
    Only the direction is asserted (the term brings the prediction closer); how
    close is a benchmark's question, not a test's. Seen under load: the term took
    the prediction from +0.2x to +3.3x against a measured +6.6x (another run:
    +0.3x, +2.9x, +4.4x); the rest is per-region Python the microbenchmark does
    not reproduce."""
    ex = make("mlp", blocks=12, width=4, hidden=8, batch=2)
    prof = profile(ex.model, ex.loss_fn, repeats=3)
    plan = Plan(
        tuple(
            UnitChoice(u.path, "selective" if u.is_block else "keep",
                       *((tuple(op.local for op in prof.unit_ops(u)[:1]),
                          (prof.unit_ops(u)[0].name,)) if u.is_block else ()))
            for u in prof.units if u.plannable
        ),
        prof.fingerprint,
    )  # fmt: skip
    with_costs = simulate(prof, plan)
    without = simulate(dataclasses.replace(prof, engine_costs=EngineCosts()), plan)
    plain_s = _cpu_step_seconds(ex)
    gradckpt.apply(ex.model, plan)
    try:
        planned_s = _cpu_step_seconds(ex)
    finally:
        gradckpt.remove(ex.model)
    measured = planned_s / plain_s - 1.0
    error_with = abs(with_costs.overhead - measured)
    error_without = abs(without.overhead - measured)
    assert with_costs.engine_time > without.recompute_time  # the engine's work dominates here
    assert error_with < error_without, (measured, with_costs.overhead, without.overhead)
