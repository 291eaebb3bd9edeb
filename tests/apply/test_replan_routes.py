"""Re-planning a new shape after ``fit``: sound, or it says so.

* A rescaled profile is used only when the forward at the new length dispatches the ops
  the scaling was fitted on: a model that branches on the length (``if T > window``) is
  profiled there instead (the rescaled plan ran 1.7x over the budget).
* User hooks never see fake tensors: a forward hook that logs ``.item()`` does not crash
  the step, one that stores activations keeps real ones; a ``loss_fn`` or ``loss_from``
  that calls ``.item()`` does not crash either.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import gradckpt
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.testing import mlp

WINDOW = 64


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if x.shape[1] > WINDOW:  # past the window: every position attends to every other
            h = torch.softmax(h @ h.transpose(1, 2), dim=-1) @ h
        return x + self.out(F.dropout(h, 0.1, self.training))


class _Windowed(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _x(length, width=16):
    return torch.randn(2, length, width, generator=torch.Generator().manual_seed(length))


def _square(out, x):
    return out.pow(2).mean()


def _squared(model, x):
    """The step: ``model(x)``'s mean square."""
    return lambda: model(x).pow(2).mean()


def _least_and_plain(model, length):
    x = _x(length)
    prof = gradckpt.profile(model, lambda: model(x).pow(2).mean(), fake=True)
    try:
        gradckpt.plan(model, lambda: None, 1, profiling=gradckpt.ProfileOptions(profile=prof))
    except gradckpt.BudgetError as exc:
        return exc.least_peak_bytes, prof.measured_peak_bytes
    raise AssertionError("a one-byte budget fitted")


def test_rescaling_is_refused_past_a_branch_on_the_length_and_the_budget_holds(peak_and_grads):
    torch.manual_seed(0)
    model = _Windowed()
    plain = copy.deepcopy(model)
    least, plain_peak = _least_and_plain(model, 2 * WINDOW)
    budget = (least + plain_peak) // 2
    x32 = _x(32)
    gradckpt.fit(model, lambda: model(x32).pow(2).mean(), budget, shapes=gradckpt.ShapeOptions(loss_from=_square), profiling=gradckpt.ProfileOptions(repeats=1),
                 measure_candidates=0)  # fmt: skip
    # 48 is profiled (the scaling is built from lengths 16..48, all inside the window);
    # 56 follows the same ops: rescaled; 128 branches: profiled, not rescaled.
    for seed, length in enumerate((48, 56, 2 * WINDOW)):
        peak, grads = peak_and_grads(model, _squared(model, _x(length)), seed)
        assert peak <= budget, (length, peak, budget)
        _, plain_grads = peak_and_grads(plain, _squared(plain, _x(length)), seed)
        assert grads.keys() == plain_grads.keys(), length
        assert all(torch.equal(grads[k], plain_grads[k]) for k in grads), length
    stats = gradckpt.shape_stats(model)
    routes = [route for _, route in stats.routes]
    assert routes == ["fitted", "fake", "rescaled", "fake"], stats.routes
    assert stats.rescaled == 1


# -- user hooks and loss side effects ------------------------------------------------------

BUDGET = "4.5MiB"  # as tests/apply/test_shapes.py: batch 256 runs plainly, 384 needs a plan


def _mlp():
    return mlp(blocks=3, width=64, hidden=256, batch=256, dropout=0.1).model


def _step(model, batch):
    g = torch.Generator().manual_seed(batch)
    x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return lambda: F.cross_entropy(model(x), y)


def _ce_from(out, x):
    return F.cross_entropy(out, torch.zeros(len(out), dtype=torch.long))


def test_user_hooks_never_see_fake_tensors_while_a_new_shape_is_planned():
    model = _mlp()
    logged, stored, seen_globally = [], [], []
    inner = next(m for m in model.modules() if isinstance(m, nn.Linear))
    inner.register_forward_hook(lambda m, args, out: logged.append(out.abs().mean().item()))
    inner.register_forward_pre_hook(lambda m, args: stored.append(args[0].detach()))
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen_globally.append(type(out)) if m is inner else None
    )
    try:
        gradckpt.fit(model, _step(model, 256), BUDGET, shapes=gradckpt.ShapeOptions(loss_from=_ce_from), profiling=gradckpt.ProfileOptions(repeats=1), measure_candidates=0)  # fmt: skip
        calls_before = len(logged)
        for batch in (384, 512):
            loss = _step(model, batch)()
            loss.backward()
    finally:
        handle.remove()
    stats = gradckpt.shape_stats(model)
    assert [r for _, r in stats.routes] == ["fitted", "fake", "fake"]  # planned on fake tensors
    # Each real forward ran the hooks once (the checkpointed blocks' recompute may add a
    # call, with real tensors); none ran on the fake profiles.
    assert len(logged) - calls_before >= 2
    assert not any(isinstance(t, FakeTensor) for t in stored)
    assert all(not issubclass(t, FakeTensor) for t in seen_globally)
    assert len(inner._forward_hooks) == 1 and len(inner._forward_pre_hooks) == 1


def test_loss_fn_that_reads_the_loss_works_with_a_given_profile_and_no_measurement():
    model = _mlp()
    step = _step(model, 256)
    prof = gradckpt.profile(model, step, repeats=1)
    values = []

    def loss_fn():
        loss = step()
        values.append(loss.item())  # a logged metric
        return loss

    gradckpt.fit(model, loss_fn, BUDGET, profiling=gradckpt.ProfileOptions(profile=prof), shapes=gradckpt.ShapeOptions(loss_from=_ce_from), measure_candidates=0)
    assert values == []  # loss_fn never ran on fake tensors (it raised there before)
    loss_fn().backward()
    assert len(values) == 1 and values[0] > 0


def test_loss_from_that_reads_a_value_takes_the_real_route_within_the_budget():
    model = _mlp()
    read = []

    def loss_from(out, x):
        read.append(out.detach().abs().max().item())  # fails on fake tensors
        return _ce_from(out, x)

    gradckpt.fit(model, _step(model, 256), BUDGET, shapes=gradckpt.ShapeOptions(loss_from=loss_from), profiling=gradckpt.ProfileOptions(repeats=1), measure_candidates=0)  # fmt: skip
    model.zero_grad(set_to_none=True)
    with AllocatorTracker() as allocator:
        _step(model, 384)().backward()
    assert state_bytes(model) + allocator.peak_bytes <= gradckpt.applied_plan(model).budget_bytes
    assert [r for _, r in gradckpt.shape_stats(model).routes] == ["fitted", "real-frugal"]
    assert all(isinstance(v, float) for v in read)


def test_a_shape_no_route_can_plan_keeps_the_old_plan_with_a_warning():
    model = _mlp()

    def loss_from(out, x):
        if out.shape[0] != 256:
            raise RuntimeError("this loss only knows batch 256")
        return _ce_from(out, x)

    gradckpt.fit(model, _step(model, 256), BUDGET, shapes=gradckpt.ShapeOptions(loss_from=loss_from), profiling=gradckpt.ProfileOptions(repeats=1), measure_candidates=0)  # fmt: skip
    old = gradckpt.applied_plan(model)
    with pytest.warns(UserWarning, match=r"could not plan the input shape .*predicted peak"):
        _step(model, 384)().backward()
    assert gradckpt.applied_plan(model) == old
    assert [r for _, r in gradckpt.shape_stats(model).routes] == ["fitted", "old-plan"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, 384)().backward()  # cached: said once


# -- kernel workspace on a conv model re-planned under fake tensors -----------------------


def _images(side, batch):
    g = torch.Generator().manual_seed(side * batch)
    x = torch.randn(batch, 3, side, side, generator=g)
    return x, torch.randn(batch, 3, side, side, generator=g)


@pytest.mark.parametrize("side,batch", [(64, 2), (32, 4)], ids=["image-64", "batch-4"])
def test_a_conv_model_replanned_under_fake_tensors_holds_the_budget_at_the_allocator(
    side, batch, peak_and_grads
):
    from gradckpt.testing import make

    model = make("unet", depth=2, base=8, image=32, batch=2).model
    plain = copy.deepcopy(model)
    (x, t), (x2, t2) = _images(32, 2), _images(side, batch)
    fake = gradckpt.profile(model, lambda: F.mse_loss(model(x2), t2), fake=True)
    try:
        gradckpt.plan(model, lambda: None, 1, profiling=gradckpt.ProfileOptions(profile=fake))
    except gradckpt.BudgetError as exc:
        least = exc.least_peak_bytes
    # Near the plain peak at the new shape: the plan the fake profile chooses (workspace
    # measured at 32 px and scaled) ran 1.1% (image 64) and 1.8% (batch 4) over it.
    budget = least + 4 * (fake.measured_peak_bytes - least) // 5
    gradckpt.fit(model, lambda: F.mse_loss(model(x), t), budget, measure_candidates=0, profiling=gradckpt.ProfileOptions(repeats=1), shapes=gradckpt.ShapeOptions(loss_from=lambda out, x: F.mse_loss(out, torch.zeros_like(out))))  # fmt: skip
    # The first call at the new shape plans it (one real step inside it: counted too).
    for seed in (0, 1):
        peak, grads = peak_and_grads(model, lambda: F.mse_loss(model(x2), t2), seed)
        _, plain_grads = peak_and_grads(plain, lambda: F.mse_loss(plain(x2), t2), seed)
        assert peak <= budget, (seed, peak, budget)
        assert grads.keys() == plain_grads.keys(), seed
        assert all(torch.equal(grads[k], plain_grads[k]) for k in grads), seed
    stats = gradckpt.shape_stats(model)
    assert [r for _, r in stats.routes] == ["fitted", "fake-verified"]
    assert stats.replans == 1
    # The prediction kept is the real step's peak at the allocator.
    active = gradckpt.applied_plan(model)
    assert active.peak_level == "allocator"
    assert abs(peak - active.predicted_peak_bytes) <= 1e-3 * peak, (peak, active)
