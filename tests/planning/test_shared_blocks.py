"""A module called several times per step (shared weights) is a unit per call, planned in order."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine.decisions import KEEP
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.planning.planner import Planner
from gradckpt.profiling.units import call_path, called_blocks, module_path
from gradckpt.testing import ResidualMLPBlock


class SharedEnds(nn.Module):
    """Four blocks between two calls of one shared block (as ALBERT-style weight tying does)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLPBlock(16, 64, 0.0) for _ in range(4))
        self.shared = ResidualMLPBlock(16, 64, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(x)
        for block in self.blocks:
            x = block(x)
        return self.shared(x)


def _setup():
    torch.manual_seed(0)
    model = SharedEnds()
    x = torch.randn(32, 16)
    return model, lambda: model(x).pow(2).mean()


def test_each_call_of_a_shared_block_is_a_unit_in_call_order():
    model, loss_fn = _setup()
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    paths = [u.path for u in prof.units]
    assert paths == ["shared#0", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "shared#1"]
    first, last = prof.units[0], prof.units[-1]
    assert (first.calls, first.call, last.calls, last.call) == (2, 0, 2, 1)
    assert first.module_path == last.module_path == "shared"
    assert all(u.plannable for u in prof.units)
    # Each call's ops are its own: the two calls run the same ops, in different places.
    assert first.end_op <= prof.units[1].first_op and prof.units[4].end_op <= last.first_op
    assert [o.name for o in prof.unit_ops(first)] == [o.name for o in prof.unit_ops(last)]


def _checkpointed(plan: Plan) -> set[str]:
    """Units whose activations the plan does not keep: recomputed, selective or in a segment."""
    out = {u.path for u in plan.units if u.mode != "keep"}
    stack = list(plan.items)
    while stack:
        item = stack.pop()
        if isinstance(item, Segment):
            out |= set(item.paths)
            stack += item.items
    return out


def test_the_planner_checkpoints_calls_of_a_shared_block():
    torch.manual_seed(0)
    model, x = Looped(), torch.randn(64, 8)
    prof = gradckpt.profile(model, lambda: model(x).pow(2).mean(), repeats=1)
    least, _ = Planner(prof).least_peak()
    assert {"core#0", "core#1"} & _checkpointed(least)
    # Below the least peak with every call kept (an older profile's view of the block).
    merged = tuple(
        dataclasses.replace(u, path=u.module_path, call=0) if u.calls > 1 else u
        for u in prof.units
    )
    kept = Planner(dataclasses.replace(prof, units=merged)).least_peak()[0]
    assert least.predicted_peak_bytes < 0.8 * kept.predicted_peak_bytes


def test_plans_name_each_call_and_round_trip(tmp_path):
    torch.manual_seed(0)
    model, x = Looped(), torch.randn(64, 8)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    plan = gradckpt.plan(model, loss_fn, budget=0.75, profiling=gradckpt.ProfileOptions(profile=prof))
    assert plan.not_planned == ()
    assert {"core#0", "core#1", "core#2"} <= {u.path for u in plan.units}
    assert {"core#0", "core#1", "core#2"} & _checkpointed(plan)
    assert "never checkpointed" not in plan.summary()
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_an_older_profiles_unit_of_all_calls_stays_kept_and_is_named():
    # Before units were per call, a shared module was one record with calls > 1: its
    # ops mix the calls, so it cannot be planned; plans say it is kept.
    model, loss_fn = _setup()
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    merged = dataclasses.replace(prof.units[0], path="shared", call=0)
    assert not merged.plannable
    old = dataclasses.replace(prof, units=(merged, *prof.units[1:-1]))
    plan = gradckpt.plan(model, loss_fn, budget=0.9, profiling=gradckpt.ProfileOptions(profile=old))
    assert plan.not_planned == (("shared", 2),)
    assert "runs 2x per step: never checkpointed" in plan.summary()


def test_call_paths_name_calls_and_their_module():
    assert call_path("encoder.layer", 2, 4) == "encoder.layer#2"
    assert call_path("head", 0, 1) == "head"
    assert module_path("encoder.layer#2") == "encoder.layer"
    assert module_path("head") == "head"


class Looped(nn.Module):
    """One block run three times, and a helper of torch's own run twice (not a block)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.core = ResidualMLPBlock(16, 32, 0.0)
        self.act = nn.GELU()
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.inp(x))
        for _ in range(3):
            x = self.core(x)
        return self.out(self.act(x))


def test_a_module_run_several_times_is_found_as_the_block():
    torch.manual_seed(0)
    model, x = Looped(), torch.randn(4, 8)
    assert called_blocks(model, lambda: model(x)) == ["core"]  # not its parts, not the GELU
    prof = gradckpt.profile(model, lambda: model(x).sum(), repeats=1)
    assert [u.path for u in prof.units if u.is_block] == ["core#0", "core#1", "core#2"]
    assert prof.blocks_note == ""


def test_a_plan_naming_some_calls_of_a_shared_module_is_refused_before_touching_it():
    model, loss_fn = _setup()
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    plan = gradckpt.plan(model, loss_fn, budget=0.9, profiling=gradckpt.ProfileOptions(profile=prof))
    items = tuple(i for i in plan.items if not (isinstance(i, UnitChoice) and i.path == "shared#1"))
    if len(items) == len(plan.items):  # shared#1 sits in a segment: keep every unit, drop it
        items = tuple(UnitChoice(u.path, KEEP) for u in plan.units if u.path != "shared#1")
    broken = dataclasses.replace(plan, items=items)
    with pytest.raises(gradckpt.PlanMismatchError, match=r"'shared' by the calls \['shared#0'\].*every call"):
        gradckpt.apply(model, broken)
    assert "forward" not in model.shared.__dict__  # nothing was installed
