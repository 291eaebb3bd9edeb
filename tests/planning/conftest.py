"""Zoo models profiled once per session, and a step runner that measures peak and grads."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gradckpt.measure import AllocatorTracker, MemoryTracker, state_bytes
from gradckpt.profiling import Profile, profile
from gradckpt.testing import Example, make

ZOO_NAMES = ["mlp", "dropout_mlp", "gpt", "resnet", "unet", "bn_convnet"]


@dataclass
class Step:
    peak: int  # the allocator's: parameters + the most it held above entry
    tracker_peak: int  # the dispatch level's (MemoryTracker)
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def run_step(ex: Example, seed: int = 7) -> Step:
    """One measured training step from a fixed RNG state; leaves grads cleared, buffers restored.

    Its peak is measured at the allocator (kernel workspaces included) and by
    the tensor tracker.
    """
    model = ex.model
    saved = {k: b.clone() for k, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with AllocatorTracker() as allocator, MemoryTracker(model) as tracker:
        loss = ex.loss_fn()
        loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for k, b in model.named_buffers():
            b.copy_(saved[k])
    peak = state_bytes(model) + allocator.peak_bytes
    return Step(peak, tracker.peak_bytes, loss.detach(), grads, buffers)


def assert_step_matches(plan, got: Step, plain: Step) -> None:
    """Bit for bit when the plan does not chunk; a chunked head and loss add their
    slices' sums in another order, so then within fp32's 1e-5 relative per tensor."""
    from gradckpt.engine.decisions import Chunk

    if not any(isinstance(u.decision, Chunk) for u in plan.units):
        assert_same_step(got, plain)
        return
    assert abs(got.loss - plain.loss) <= 1e-5 * abs(plain.loss)
    assert got.grads.keys() == plain.grads.keys()
    for name, ref in plain.grads.items():
        diff = (got.grads[name] - ref).norm()
        assert diff <= 1e-5 * ref.norm(), f"gradient of {name}: {diff} from {ref.norm()}"
    for name in plain.buffers:
        assert torch.equal(got.buffers[name], plain.buffers[name]), f"buffer {name} differs"


@pytest.fixture
def no_chunking():
    """Plans made in the test keep, recompute, select or offload only (no ``Chunk``):
    for tests of those kinds' bit-for-bit exactness and of their own floors."""
    from gradckpt.planning.kinds.chunk.handler import allow_chunking

    with allow_chunking(False):
        yield


def assert_same_step(a: Step, b: Step) -> None:
    assert torch.equal(a.loss, b.loss)
    assert a.grads.keys() == b.grads.keys()
    for name in a.grads:
        assert torch.equal(a.grads[name], b.grads[name]), f"gradient of {name} differs"
    for name in a.buffers:
        assert torch.equal(a.buffers[name], b.buffers[name]), f"buffer {name} differs"


class Zoo:
    def __init__(self) -> None:
        self._cache: dict[str, tuple[Example, Profile, Step]] = {}

    def get(self, name: str) -> tuple[Example, Profile, Step]:
        if name not in self._cache:
            ex = make(name)
            prof = profile(ex.model, ex.loss_fn, repeats=1)
            self._cache[name] = (ex, prof, run_step(ex))
        return self._cache[name]


@pytest.fixture(scope="session")
def zoo() -> Zoo:
    return Zoo()


def frontier_budgets(prof: Profile) -> list[int]:
    """Budgets across a profile's frontier: the least peak, the plain one, every block's, between."""
    from gradckpt.planning.solving.solvers import every_kth_plan, finish, least_peak_plan

    _, least = least_peak_plan(prof)
    plain = prof.measured_peak_bytes
    _, every = finish(prof, every_kth_plan(prof, 1), None, "every_block")
    points = {least.peak_bytes, plain}
    if every.peak_bytes < plain:
        points.add(every.peak_bytes)
    points.update(
        least.peak_bytes + round(f * (plain - least.peak_bytes)) for f in (0.25, 0.5, 0.75)
    )
    return sorted(points)


def assert_dp_not_slower_than_baselines(name: str, prof: Profile) -> None:
    """At every frontier budget, the DP's plan is predicted no slower than any baseline that
    fits, but for the solver's tie: a baseline replaces the DP's plan only when faster by
    more than it (issue #31), so the DP's may be slower by up to that."""
    from gradckpt.planning.solve import solve
    from gradckpt.planning.solving.budget import BudgetError
    from gradckpt.planning.solving.solvers import SOLVERS, tie_seconds

    tie = tie_seconds(prof)

    for budget in frontier_budgets(prof):
        dp = solve(prof, budget, "dp")
        for solver in SOLVERS:
            if solver == "dp":
                continue
            try:
                baseline = solve(prof, budget, solver)
            except BudgetError:
                continue
            assert dp.predicted_step_time <= (baseline.predicted_step_time + tie) * (1 + 1e-9), (
                f"{name} at {budget}: dp {dp.predicted_step_time:.5f}s > "
                f"{solver} {baseline.predicted_step_time:.5f}s"
            )
