"""The top-level verbs and the package surface."""

from __future__ import annotations

import subprocess
import sys

import torch

import gradckpt
from gradckpt.testing import make


def test_plan_leaves_the_model_exactly_as_found():
    ex = make("gpt")  # dropout draws from the RNG during profiling
    torch.manual_seed(11)
    ex.loss_fn().backward()
    state = {k: v.clone() for k, v in ex.model.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in ex.model.named_parameters()}
    rng = torch.get_rng_state()
    plan = gradckpt.plan(ex.model, ex.loss_fn, budget=0.9, profiling=gradckpt.ProfileOptions(repeats=1))
    assert isinstance(plan, gradckpt.Plan) and plan.budget_bytes is not None
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in ex.model.state_dict().items())
    assert all(torch.equal(p.grad, grads[k]) for k, p in ex.model.named_parameters())
    assert gradckpt.applied_plan(ex.model) is None


def test_fit_applies_the_plan_it_returns():
    ex = make("gpt")
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget=0.8, profiling=gradckpt.ProfileOptions(repeats=1))
    assert gradckpt.applied_plan(ex.model) is plan
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    # Planning again on an applied model measures the plain model, not the plan.
    again = gradckpt.plan(ex.model, ex.loss_fn, budget=0.8, profiling=gradckpt.ProfileOptions(repeats=1))
    assert again.baseline_peak_bytes == plan.baseline_peak_bytes
    gradckpt.remove(ex.model)


def test_frontier_goes_from_least_peak_to_plain():
    ex = make("gpt")
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    points = gradckpt.frontier(ex.model, ex.loss_fn, profile=prof)
    peaks = [p.peak_bytes for p in points]
    overheads = [p.overhead for p in points]
    assert len(points) >= 3
    assert peaks == sorted(peaks) and overheads == sorted(overheads, reverse=True)
    assert peaks[-1] == prof.measured_peak_bytes and overheads[-1] == 0.0
    for point in points:
        assert gradckpt.simulate(prof, point.plan).peak_bytes == point.peak_bytes


def test_public_names_exist():
    for name in gradckpt.__all__:
        assert hasattr(gradckpt, name), name
    for name in ("save_all", "recompute_all", "save_matmuls", "save_names", "either"):
        assert callable(getattr(gradckpt.policies, name))
    assert callable(gradckpt.plan) and callable(gradckpt.planning.simulate)
    assert gradckpt.measure.MemoryTracker is not None


def test_import_stays_light():
    code = (
        "import sys, gradckpt, torch; "
        "heavy = [m for m in ('transformers', 'scipy', 'matplotlib', 'rich') if m in sys.modules]; "
        "print(heavy, torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False"
