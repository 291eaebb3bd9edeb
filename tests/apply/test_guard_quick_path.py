"""The root wrapper skips the shape check for a call with the last checked call's shapes.

Reaching the guard and building a call's key cost more than the rest of the
root wrapper's work on short steps (issue #42); a call that reads the same as the
last checked one (plain tensors of the same shapes, dtypes and gradient flags,
equal plain values) has its key, so while that key's plan is active the check is
skipped. Anything else, a new shape above all, is checked as before.
"""

from __future__ import annotations

import importlib

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
