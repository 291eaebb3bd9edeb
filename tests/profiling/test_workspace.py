"""Per-op workspace in the profile: what kernels allocate beyond their outputs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gradckpt.measure import AllocatorTracker
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.solvers import none_plan
from gradckpt.profiling import Profile, profile
from gradckpt.testing import make


def test_convolution_backward_has_workspace_and_it_sets_the_peak():
    ex = make("unet", depth=2, base=16, image=64, batch=2)
    prof = profile(ex.model, ex.loss_fn, repeats=1)
    conv_bwd = [o for o in prof.ops if o.name == "aten.convolution_backward.default"]
    assert conv_bwd and all(o.backward for o in conv_bwd)
    assert max(o.workspace for o in conv_bwd) > 0
    assert prof.measured_peak_bytes > prof.tracker_peak_bytes
    # The plain plan on the simulator, workspace included, is the allocator's peak.
    assert simulate(prof, none_plan(prof)).peak_bytes == prof.measured_peak_bytes


def test_workspace_of_one_op_is_peak_minus_before_minus_outputs():
    # A linear layer: addmm allocates its output and nothing else on CPU.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    x = torch.randn(32, 64)
    prof = profile(model, lambda: model(x).sum(), repeats=1)
    addmm = [o for o in prof.ops if o.name == "aten.addmm.default"]
    assert addmm and all(o.workspace == 0 for o in addmm)
    assert prof.measured_peak_bytes == prof.tracker_peak_bytes


def test_inside_another_profiler_it_warns_and_falls_back_to_tensors():
    ex = make("mlp")
    with torch.profiler.profile(), pytest.warns(UserWarning, match="another torch profiler"):
        prof = profile(ex.model, ex.loss_fn, repeats=1)
    assert prof.peak_level == "tensors" and prof.measured_peak_bytes == prof.tracker_peak_bytes
    assert all(o.workspace == 0 for o in prof.ops)


def test_json_round_trip_keeps_workspace_and_old_files_load(tmp_path):
    ex = make("bn_convnet")
    prof = profile(ex.model, ex.loss_fn, repeats=1)
    assert any(o.workspace for o in prof.ops)
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof
    # A version-1 file (before workspace): loads with zero workspace, one peak.
    old = prof.to_json()
    old["version"] = 1
    for key in ("tracker_peak_bytes", "peak_level"):
        del old[key]
    for op in old["ops"]:
        del op["workspace"]
    path.write_text(json.dumps(old))
    loaded = Profile.load(path)
    assert loaded.peak_level == "tensors" and all(o.workspace == 0 for o in loaded.ops)
    assert loaded.tracker_peak_bytes == loaded.measured_peak_bytes == prof.measured_peak_bytes


def test_profiled_step_peak_matches_a_separate_allocator_measurement():
    ex = make("resnet")
    prof = profile(ex.model, ex.loss_fn, repeats=1)
    torch.manual_seed(0)
    with AllocatorTracker() as at:
        ex.loss_fn().backward()
    assert prof.measured_peak_bytes == prof.param_bytes + at.peak_bytes
