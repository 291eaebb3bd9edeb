"""The decision-kind registry: built-in kinds, old plan files, and a new kind in one module.

``SaveEverything`` below is a toy kind written the way a real one is (as issue
#12's Offload is): a Decision dataclass, one handler registered for it,
nothing else. The tests then run it through every layer that dispatches on
kinds: the DP chain, the simulator, the summary, plan files and apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import gradckpt
from gradckpt import policies
from gradckpt.apply.apply import applied_units
from gradckpt.engine import in_region_forward
from gradckpt.engine.decisions import Decision, decision_kind, forget_decision_kind
from gradckpt.measure import count_flops
from gradckpt.planning import Plan, Segment, UnitChoice, simulate
from gradckpt.planning.handlers.registry import forget, handler_for, handlers, register
from gradckpt.planning.kinds.recompute import RecomputeHandler
from gradckpt.planning.solving.chain import build_chain
from gradckpt.profiling.records import UnitRecord

from .conftest import assert_same_step, run_step

# ------------------------------------------------------------ the toy kind's "module"


@decision_kind("save_everything")
@dataclass(frozen=True)
class SaveEverything(Decision):
    """A region whose policy keeps every op's outputs: keep's memory, through a region."""


class SaveEverythingHandler(RecomputeHandler):
    decision = SaveEverything
    asks_policy = True
    compiled_body = False

    def kept_ops(self, unit: UnitRecord, decision: Decision) -> frozenset[int]:
        return frozenset(range(unit.first_op, unit.end_op))

    def stage_options(self, profile, unit, look):
        # Offered only when planning asks for it (as offload is, with its link's settings).
        wanted = look.settings.get(SaveEverything, False)
        return [SaveEverything()] if wanted and unit.is_block else []

    def policy(self, path, decision):
        return policies.save_all

    def describe(self, decision):
        return "toy region (keeps every op output)"

    def install(self, plan):
        return []  # one per applied plan, shared by its toy units: the paths they ran

    def run(self, unit, args, kwargs, *, in_recompute):
        unit.runtime.append(unit.path)
        return super().run(unit, args, kwargs, in_recompute=in_recompute)


@pytest.fixture
def toy_kind():
    decision_kind("save_everything")(SaveEverything)  # as importing its module would
    handler = register(SaveEverythingHandler())
    yield handler
    forget(SaveEverything)
    forget_decision_kind("save_everything")


# ------------------------------------------------------------------ built-in kinds


def test_builtin_kinds_are_registered_in_option_order():
    kinds = [h.decision for h in handlers()]
    assert kinds[:5] == [gradckpt.Keep, gradckpt.Recompute, gradckpt.Offload,
                         gradckpt.RecomputeOffload, gradckpt.Selective]  # fmt: skip
    assert not handler_for(gradckpt.Keep()).opens_region
    assert handler_for(gradckpt.Recompute()).opens_region
    assert not handler_for(gradckpt.Selective()).compiled_body


def test_plan_files_in_the_old_format_still_load():
    # Written by gradckpt before decisions were typed (mode strings, version 1).
    old = {
        "kind": "gradckpt.Plan", "version": 1, "fingerprint": "abc",
        "items": [
            {"path": "emb", "mode": "keep"},
            {"segment": [{"path": "b.0", "mode": "recompute"}, {"path": "b.1", "mode": "keep"}]},
            {"path": "b.2", "mode": "selective", "save": [1, 4],
             "save_ops": ["aten.mm.default", "aten.addmm.default"]},
        ],
    }  # fmt: skip
    plan = Plan.from_json(old)
    assert plan.items[0] == UnitChoice("emb", gradckpt.Keep())
    assert plan.items[1] == Segment(
        (UnitChoice("b.0", gradckpt.Recompute()), UnitChoice("b.1", gradckpt.Keep()))
    )
    selective = gradckpt.Selective((1, 4), ("aten.mm.default", "aten.addmm.default"))
    assert plan.items[2] == UnitChoice("b.2", selective)
    assert plan.to_json()["items"] == old["items"]  # and written back the same way


def test_offload_named_in_a_plan_file_runs(zoo):
    ex, prof, plain = zoo.get("mlp")
    block = ex.block_paths[0]
    data = Plan((UnitChoice(block, "recompute"),), prof.fingerprint).to_json()
    data["items"][0]["mode"] = "offload"
    plan = Plan.from_json(data)  # a plan file may name it, and it runs (issue #12)
    assert plan.units[0].decision == gradckpt.Offload()
    assert simulate(prof, plan).host_bytes >= 0
    gradckpt.apply(ex.model, plan)
    try:
        assert_same_step(plain, run_step(ex))
    finally:
        gradckpt.remove(ex.model)


# --------------------------------------------------------- a new kind, end to end


def _toy_plan(prof, kind: Decision) -> Plan:
    items = tuple(
        UnitChoice(u.path, kind if u.is_block else gradckpt.Keep())
        for u in prof.units
        if u.plannable
    )
    return Plan(items, prof.fingerprint)


def test_a_registered_kind_is_offered_to_the_dp_and_simulated(zoo, toy_kind):
    _, prof, _ = zoo.get("dropout_mlp")
    assert not any(SaveEverything() in options for options in build_chain(prof).options)
    model = build_chain(prof, settings={SaveEverything: True})
    for unit, options, stage in zip(model.units, model.options, model.chain.stages):
        assert (SaveEverything() in options) == unit.is_block
        if unit.is_block:
            k = options.index(SaveEverything())
            assert stage.options[k].name == "save_everything"
    toy = simulate(prof, _toy_plan(prof, SaveEverything()))
    recompute = simulate(prof, _toy_plan(prof, gradckpt.Recompute()))
    assert toy.recompute_flops == 0 < recompute.recompute_flops
    assert toy.recompute_time == 0.0
    assert "toy region (keeps every op output)" in _toy_plan(prof, SaveEverything()).summary()


def test_a_registered_kind_round_trips_through_a_plan_file(zoo, toy_kind, tmp_path):
    _, prof, _ = zoo.get("mlp")
    plan = _toy_plan(prof, SaveEverything())
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_a_registered_kind_runs_through_apply(zoo, toy_kind):
    ex, prof, plain = zoo.get("dropout_mlp")
    plan = _toy_plan(prof, SaveEverything())
    seen: list[bool] = []
    # A hook inside each block (on its first child) sees whether a region is running.
    hooks = [
        next(ex.model.get_submodule(p).children()).register_forward_hook(
            lambda *a: seen.append(in_region_forward())
        )
        for p in ex.block_paths
    ]

    def backward_flops(applied: Plan | None) -> int:
        if applied is not None:
            gradckpt.apply(ex.model, applied)
        try:
            return count_flops(lambda: ex.loss_fn().backward()).total
        finally:
            ex.model.zero_grad(set_to_none=True)
            gradckpt.remove(ex.model)

    try:
        gradckpt.apply(ex.model, plan)
        specs = applied_units(ex.model)
        shared = specs[ex.block_paths[0]].runtime
        assert all(specs[p].runtime is shared for p in ex.block_paths)  # installed once
        step = run_step(ex)
        assert shared == ex.block_paths  # each toy unit ran through its handler once
        gradckpt.remove(ex.model)
        # Each block's forward ran inside a region (the recompute replays come after).
        assert seen[: len(ex.block_paths)] == [True] * len(ex.block_paths)
        assert_same_step(step, plain)  # dropout on: bit-equal gradients
        # Every op output kept: no recompute, unlike the same regions recomputing.
        flops = backward_flops(None)
        assert backward_flops(plan) == flops
        assert backward_flops(_toy_plan(prof, gradckpt.Recompute())) > flops
    finally:
        for h in hooks:
            h.remove()
        gradckpt.remove(ex.model)
