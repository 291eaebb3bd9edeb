"""Engine costs: measured once per process and device, carried by profiles, data in JSON."""

from __future__ import annotations

import dataclasses
import json

import gradckpt
from gradckpt.measure.engine_costs import EngineCosts, engine_costs, measure_engine_costs
from gradckpt.testing import make


def test_measured_costs_are_positive_where_python_runs_per_op():
    # Three measurements: each cost is a difference of timed steps, and under load
    # (the suite's other worker and more) one of them read 0 in a CI run.
    measured = [measure_engine_costs("cpu") for _ in range(3)]
    assert all(c.device == "cpu" for c in measured)
    # A recompute and a selective forward run every op through a Python dispatch
    # mode, and a region captures RNG state and installs hooks: never free.
    for cost in ("recompute_op", "policy_op", "region", "host_op"):
        assert max(getattr(c, cost) for c in measured) > 0, cost
    assert all(c.saved_tensor >= 0 and c.lean_op >= 0 for c in measured)
    # The recompute's dispatch mode costs something per op that the lean path does not pay.
    assert max(c.recompute_op - c.lean_op for c in measured) > 0


def test_costs_are_measured_once_per_process_and_device():
    assert engine_costs("cpu") is engine_costs("cpu")
    assert engine_costs("meta") == EngineCosts(device="meta")  # nothing runs there


def test_profiles_carry_the_process_costs_through_json(tmp_path):
    ex = make("mlp", blocks=2, width=8, hidden=16, batch=2)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    # The process's per-op costs, and the timings of the model's first block (issue #31).
    per_op = dataclasses.replace(prof.engine_costs, unit="", unit_region=0.0, unit_policy=0.0,
                                 unit_step=0.0, unit_region_step=0.0,
                                 unit_forward=0.0)  # fmt: skip
    assert per_op == engine_costs("cpu")
    assert prof.engine_costs.unit == "blocks.0"
    path = tmp_path / "profile.json"
    prof.save(path)
    assert gradckpt.Profile.load(path).engine_costs == prof.engine_costs
    data = json.loads(path.read_text())
    del data["engine_costs"]  # a profile saved before engine costs existed
    assert gradckpt.Profile.from_json(data).engine_costs == EngineCosts()
