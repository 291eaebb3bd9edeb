"""One shape guard on every path that runs a plan: batches the key must look inside (a dict,
a dataclass, a dict in a keyword, a plain value), copies of a fitted model, a plan applied
alone or loaded from a single-plan file, and a plan applied again after ``fit``."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradckpt
from gradckpt.testing import mlp

WIDTH, CLASSES = 64, 10
# As in test_shapes: above the plain peak at batch 256, below it at 384 and 512.
BUDGET = "4.5MiB"


@dataclass
class Batch:
    x: torch.Tensor


class DictModel(nn.Module):
    """Takes its batch as one dict, a dataclass, or a dict in the keyword ``inputs``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(blocks=3, width=WIDTH, hidden=256, batch=256, dropout=0.1).model

    def forward(self, batch=None, inputs=None):
        source = batch if batch is not None else inputs
        return self.net(source.x if isinstance(source, Batch) else source["x"])


def _x(batch: int) -> torch.Tensor:
    return torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(batch))


def _as(form: str, x: torch.Tensor) -> tuple[tuple, dict]:
    if form == "dict":
        return ({"x": x},), {}
    if form == "dataclass":
        return (Batch(x),), {}
    return (), {"inputs": {"x": x}}  # a dict inside a keyword argument


def _step(model, batch: int, form: str = "dict"):
    args, kwargs = _as(form, _x(batch))
    return lambda: F.cross_entropy(model(*args, **kwargs), torch.zeros(batch, dtype=torch.long))


def _loss_from(out, *args, **kwargs):
    return F.cross_entropy(out, torch.zeros(len(out), dtype=torch.long))


@functools.cache
def _profile(form: str):
    model = DictModel()
    return gradckpt.profile(model, _step(model, 256, form), repeats=1)


def _fit(form: str = "dict", **options):
    model = DictModel()
    plan = gradckpt.fit(
        model, _step(model, 256, form), BUDGET, shapes=gradckpt.ShapeOptions(loss_from=_loss_from), profiling=gradckpt.ProfileOptions(profile=_profile(form)), **options,
    )  # fmt: skip
    return model, plan


def _gradckpt_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("gradckpt:")]


@pytest.mark.parametrize("form", ["dict", "dataclass", "kwarg_dict"])
def test_a_new_shape_inside_a_batch_is_replanned_and_holds_the_budget(form, peak_and_grads):
    # Before: the key saw no tensor in these calls, so batch 384 ran the plan made for
    # 256 (plainly) at 4.9 MiB against 4.5 MiB, with no re-plan and no warning.
    model, plan = _fit(form)
    plain = copy.deepcopy(model)
    gradckpt.remove(plain)
    _, want = peak_and_grads(plain, _step(plain, 384, form))
    peak, grads = peak_and_grads(model, _step(model, 384, form))
    assert peak <= plan.budget_bytes
    stats = gradckpt.shape_stats(model)
    assert stats.replans == 1 and "(384,64):float32" in stats.active
    assert all(torch.equal(grads[k], want[k]) for k in want)  # dropout on, same seed


def test_warn_and_error_speak_before_running_a_new_shape_inside_a_dict(peak_and_grads):
    model, _ = _fit(on_new_shape="error")
    with pytest.raises(gradckpt.ShapeError, match=r"\[0\]\.x=\(384,64\)"):
        peak_and_grads(model, _step(model, 384))
    assert all(p.grad is None for p in model.parameters())  # nothing ran
    model, _ = _fit(on_new_shape="warn")
    with pytest.warns(UserWarning, match="on_new_shape='warn'") as caught:
        peak_and_grads(model, _step(model, 384))
    assert len(_gradckpt_warnings(caught)) == 1


class Partial(nn.Module):
    """Runs the first ``depth`` blocks: a plain int argument that changes the step's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(blocks=3, width=WIDTH, hidden=256, batch=256).model

    def forward(self, x, depth: int, options=None):
        x = self.net.inp(x)
        for block in self.net.blocks[:depth]:
            x = block(x)
        return self.net.head(x)


def _partial_step(model, depth, options=None):
    x = _x(256)
    return lambda: F.cross_entropy(model(x, depth, options), torch.zeros(256, dtype=torch.long))


def test_a_plain_argument_that_changes_memory_is_a_new_shape(peak_and_grads):
    model = Partial()
    gradckpt.fit(model, _partial_step(model, 1), "64MiB", shapes=gradckpt.ShapeOptions(on_new_shape="error"))
    peak_and_grads(model, _partial_step(model, 1))
    with pytest.raises(gradckpt.ShapeError, match="3"):  # before: ran unchecked
        peak_and_grads(model, _partial_step(model, 3))


class Options:
    """Something the key cannot read."""


def test_an_argument_the_key_cannot_read_is_named_once(peak_and_grads):
    model = Partial()
    options = Options()
    gradckpt.fit(model, _partial_step(model, 3, options), "64MiB")
    with pytest.warns(UserWarning, match=r"cannot read .*\[2\] \(Options\)") as caught:
        peak_and_grads(model, _partial_step(model, 3, options))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named once, not per call
        for _ in range(2):
            peak_and_grads(model, _partial_step(model, 3, options))
    assert len([m for m in _gradckpt_warnings(caught) if "cannot read" in m]) == 1


def _pickled(model):
    return pickle.loads(pickle.dumps(model))


def _torch_saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_deepcopy_of_a_fitted_model_keeps_its_guard_and_replans(peak_and_grads):
    # Before: the copy had no guard; batch 384 ran at 4.9 MiB against 4.5 MiB, silently.
    model, plan = _fit()
    twin = copy.deepcopy(model)
    stats = gradckpt.shape_stats(twin)
    assert stats is not None and stats.policy == "replan"
    peak, _ = peak_and_grads(twin, _step(twin, 384))
    assert peak <= plan.budget_bytes
    assert gradckpt.shape_stats(twin).replans == 1
    assert gradckpt.shape_stats(model).replans == 0  # the original is untouched
    assert gradckpt.applied_plan(model) is plan


@pytest.mark.parametrize("copier", [_pickled, _torch_saved])
def test_a_pickled_copy_keeps_plans_and_budget_and_warns_once_per_new_shape(copier, peak_and_grads):
    model, plan = _fit()
    twin = copier(model)
    stats = gradckpt.shape_stats(twin)
    assert stats is not None and stats.policy == "warn"  # no planner travels with a pickle
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peak_and_grads(twin, _step(twin, 256))  # the fitted shape: silent
    with pytest.warns(UserWarning, match="pickled") as caught:
        peak_and_grads(twin, _step(twin, 384))
    [message] = _gradckpt_warnings(caught)
    assert f"budget of {plan.budget_bytes / 2**20:.2f} MiB" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peak_and_grads(twin, _step(twin, 384))


def _mlp_and_plan():
    ex = mlp(blocks=3, width=WIDTH, hidden=256, batch=256, dropout=0.1)
    step = lambda: F.cross_entropy(ex.model(_x(256)), torch.zeros(256, dtype=torch.long))  # noqa: E731
    return ex.model, gradckpt.plan(ex.model, step, BUDGET, profiling=gradckpt.ProfileOptions(repeats=1))


def _mlp_step(model, batch):
    return lambda: F.cross_entropy(model(_x(batch)), torch.zeros(batch, dtype=torch.long))


def test_a_plan_applied_alone_warns_once_per_new_shape_not_per_unit(peak_and_grads):
    # Before: the units' check warned once per unit at the first call (one per block and
    # more), and never again: later calls at other shapes ran silently.
    model, plan = _mlp_and_plan()
    gradckpt.apply(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            peak_and_grads(model, _mlp_step(model, 256))
    for batch in (384, 512):
        with pytest.warns(UserWarning, match=rf"\({batch},64\).*on_new_shape='warn'") as caught:
            for _ in range(2):
                peak_and_grads(model, _mlp_step(model, batch))
        assert len(_gradckpt_warnings(caught)) == 1
    assert gradckpt.shape_stats(model).warnings == 2


def test_a_plan_applied_alone_first_called_at_another_shape_warns_once(peak_and_grads):
    model, plan = _mlp_and_plan()
    gradckpt.apply(model, plan)
    with pytest.warns(UserWarning) as caught:
        peak_and_grads(model, _mlp_step(model, 384))
    assert len(_gradckpt_warnings(caught)) == 1


@pytest.mark.parametrize("policy", ["error", "warn"])
def test_a_single_plan_file_loaded_as_a_set_is_guarded(tmp_path, policy, peak_and_grads):
    # Before: its key was None, "nothing to compare with": every shape ran silently.
    model, plan = _mlp_and_plan()
    plan.save(tmp_path / "plan.json")
    plans = gradckpt.PlanSet.load(tmp_path / "plan.json")
    gradckpt.apply(model, plans, on_new_shape=policy)
    peak_and_grads(model, _mlp_step(model, 256))  # the planned shape: learned, silent
    if policy == "error":
        with pytest.raises(gradckpt.ShapeError, match=r"\(384,64\).*plans only for \(256,64\)"):
            peak_and_grads(model, _mlp_step(model, 384))
        assert all(p.grad is None for p in model.parameters())  # refused before running
    else:
        with pytest.warns(UserWarning, match=r"\(384,64\).*made for \(256,64\)"):
            peak_and_grads(model, _mlp_step(model, 384))
    assert gradckpt.shape_stats(model).policy == policy


def test_another_plan_applied_after_fit_warns_with_its_predicted_peak(peak_and_grads):
    # Before: applying by hand ended fit's guard; a new shape then ran unchecked.
    model, plan = _fit()
    gradckpt.apply(model, plan)  # fit's own plan: its guard stays (test_shapes checks it)
    assert gradckpt.shape_stats(model).policy == "replan"
    other = gradckpt.plan(model, _step(model, 256), "64MiB", profiling=gradckpt.ProfileOptions(profile=_profile("dict")))
    assert other != plan
    gradckpt.apply(model, other)
    peak_and_grads(model, _step(model, 256))
    with pytest.warns(UserWarning, match="predicted peak at this shape is") as caught:
        peak, _ = peak_and_grads(model, _step(model, 384))
    [message] = _gradckpt_warnings(caught)
    assert f"{peak / 2**20:.2f} MiB" in message  # the predictor of fit's guard, exact here
