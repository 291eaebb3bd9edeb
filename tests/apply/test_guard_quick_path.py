"""The root wrapper skips the shape check for a call with the last checked call's shapes.

Reaching the guard and building a call's key cost more than the rest of the
root wrapper's work on short steps (issue #42); a call that reads the same as the
last checked one (plain tensors of the same shapes, dtypes and gradient flags,
equal plain values) has its key, so while that key's plan is active the check is
skipped. Anything else, a new shape above all, is checked as before.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import gradckpt
from gradckpt.testing import make

guard = importlib.import_module("gradckpt.apply.guard")


def test_equal_quick_signatures_mean_equal_keys():
    from gradckpt.planning.plans.call_key import shape_key

    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    assert guard.quick_sig((x,), {"n": 4}) == guard.quick_sig((y,), {"n": 4})
    assert shape_key((x,), {"n": 4}) == shape_key((y,), {"n": 4})
    different = [
        ((torch.zeros(2, 4),), {"n": 4}),  # a shape
        ((torch.zeros(2, 3, dtype=torch.float64),), {"n": 4}),  # a dtype
        ((torch.zeros(2, 3, requires_grad=True),), {"n": 4}),  # a gradient flag
        ((x,), {"n": 5}),  # a plain value
        ((x,), {"m": 4}),  # a keyword's name
    ]
    for args, kwargs in different:
        assert guard.quick_sig(args, kwargs) != guard.quick_sig((x,), {"n": 4})
    assert guard.quick_sig(([x],), {}) is None  # a container: the full key reads it
    assert guard.quick_sig((torch.nn.Parameter(x),), {}) is None  # a subclass too


def test_a_repeated_shape_reuses_its_key_and_a_new_one_is_keyed(monkeypatch):
    from gradckpt.apply import guard_routing

    ex = make("gpt", layers=2, d_model=32, heads=2, seq=16, vocab=128, batch=2)
    gradckpt.fit(ex.model, ex.loss_fn, budget=1.0, measure_candidates=0)
    keyed = []
    real = guard_routing.shape_key
    monkeypatch.setattr(
        guard_routing, "shape_key", lambda a, k: keyed.append(a[0].shape) or real(a, k)
    )
    idx = ex.inputs["idx"]
    before = gradckpt.shape_stats(ex.model).calls
    for _ in range(3):
        ex.model(idx).sum().backward()
    assert len(keyed) <= 1  # at most the first call after fit, then read from the cache
    assert gradckpt.shape_stats(ex.model).calls == before + 3  # every call is still checked
    shorter = idx[:, :8].contiguous()
    ex.model(shorter).sum().backward()  # a new shape: keyed (and re-planned)
    assert keyed[-1] == shorter.shape
    stats = gradckpt.shape_stats(ex.model)
    assert stats.plans == 2
    ex.model(idx).sum().backward()  # back to the first shape: switched back
    assert gradckpt.shape_stats(ex.model).switches >= 2
    gradckpt.remove(ex.model)


def _check_calls(monkeypatch) -> list[int]:
    """Calls that took the guard's step-by-step check (``guard.check``)."""
    seen: list[int] = []
    real = guard.check
    monkeypatch.setattr(guard, "check", lambda f, a, k: seen.append(1) or real(f, a, k))
    return seen


def test_a_plan_without_segments_begins_the_usual_steps_without_the_full_check(monkeypatch):
    ex = make("gpt", layers=2, d_model=32, heads=2, seq=16, vocab=128, batch=2)
    torch.manual_seed(0)
    ex.loss_fn().backward()
    plain = {n: p.grad.clone() for n, p in ex.model.named_parameters()}
    ex.model.zero_grad(set_to_none=True)
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget=0.95, measure_candidates=0, chunking=False)
    assert any(u.mode != "keep" for u in plan.units)  # the gradients below say something
    assert ex.model.__dict__["forward"].lean
    checked = _check_calls(monkeypatch)
    ex.loss_fn().backward()  # the first call after fit may be checked in full
    ex.model.zero_grad(set_to_none=True)
    before, calls = len(checked), gradckpt.shape_stats(ex.model).calls
    torch.manual_seed(0)
    ex.loss_fn().backward()
    assert len(checked) == before  # the usual call: the guard's lean path
    assert gradckpt.shape_stats(ex.model).calls == calls + 1  # still counted
    assert all(torch.equal(p.grad, plain[n]) for n, p in ex.model.named_parameters())
    ex.model.zero_grad(set_to_none=True)
    ex.model(ex.inputs["idx"][:, :8].contiguous()).sum().backward()  # a new shape
    assert len(checked) > before  # checked in full (and the re-plan's profile calls too)
    assert gradckpt.shape_stats(ex.model).replans == 1


def test_a_call_inside_the_step_or_one_that_raised_is_checked_in_full(monkeypatch):
    ex = make("gpt", layers=2, d_model=32, heads=2, seq=16, vocab=128, batch=2)
    gradckpt.fit(ex.model, ex.loss_fn, budget=1.0, measure_candidates=0, chunking=False)
    idx = ex.inputs["idx"]
    ex.model(idx).sum().backward()
    checked = _check_calls(monkeypatch)
    out = ex.model(idx)  # begins a step (lean)
    (out.sum() + ex.model(idx).sum()).backward()  # the step's second call: in full
    assert len(checked) == 1
    with torch.no_grad():
        ex.model(idx)  # no step: in full (the guard lets it pass)
    assert len(checked) == 2
    block = ex.model.blocks[0]
    monkeypatch.setattr(block, "forward", lambda *a, **k: (_ for _ in ()).throw(KeyError("x")))
    with pytest.raises(KeyError):
        ex.model(idx)
    monkeypatch.undo()
    assert guard.guard_of(ex.model)._steps.current is None  # the raised step was dropped


def test_a_plan_with_segments_runs_the_root_in_full():
    from gradckpt.planning import Plan, Segment, UnitChoice
    from gradckpt.profiling import model_fingerprint

    ex = make("gpt", layers=4, d_model=32, heads=2, seq=16, vocab=128, batch=2)
    items = (
        *(UnitChoice(p) for p in ("tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1")),
        Segment((UnitChoice("blocks.2"), UnitChoice("blocks.3"))),
        UnitChoice("ln_f"), UnitChoice("lm_head"),
    )  # fmt: skip
    gradckpt.apply(ex.model, Plan(items, model_fingerprint(ex.model)))
    assert not ex.model.__dict__["forward"].lean  # its segments need the root's bookkeeping


def test_copies_count_their_usual_calls_on_their_own_guards(monkeypatch):
    import copy
    import io

    ex = make("gpt", layers=2, d_model=32, heads=2, seq=16, vocab=128, batch=2)
    gradckpt.fit(ex.model, ex.loss_fn, budget=1.0, measure_candidates=0, chunking=False)
    idx = ex.inputs["idx"]
    ex.model(idx).sum().backward()
    saved_calls = gradckpt.shape_stats(ex.model).calls  # a copy carries the counters
    buffer = io.BytesIO()
    torch.save(ex.model, buffer)
    buffer.seek(0)
    pickled = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(ex.model)
    checked = _check_calls(monkeypatch)
    # A deep copy's guard is bound to it at once; a pickled copy's at its first call,
    # which the full check makes (a guard not yet bound has no owner to run lean for).
    for model, full in ((twin, 0), (pickled, 1)):
        seen = len(checked)
        for _ in range(3):
            model(idx).sum().backward()
        assert len(checked) - seen == full  # every other call: the lean path
        assert guard.guard_of(model).owner() is model
        assert gradckpt.shape_stats(model).calls == saved_calls + 3  # counted on the copy
    assert gradckpt.shape_stats(ex.model).calls == saved_calls  # not on the original
