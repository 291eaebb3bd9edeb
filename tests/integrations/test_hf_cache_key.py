"""The KV-cache pre-hook does not change a training call's shape key."""

from __future__ import annotations

import pytest
import torch

import gradckpt

transformers = pytest.importorskip("transformers")


def test_the_fitted_call_keeps_its_plan_after_the_cache_hook_adds_use_cache():
    """gradckpt's own pre-hook adds ``use_cache=False`` to training calls that do not
    pass it; the guard read it as a new plain value, so the very call ``fit`` planned
    was re-planned at its first step after ``fit`` (about 4 s under fake tensors)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=128)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (4, 64))
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    gradckpt.fit(model, loss_fn, 0.85, measure_candidates=0)
    # Fitted again: the hook from the first fit is on the model while this one records.
    gradckpt.fit(model, loss_fn, 0.9, measure_candidates=0)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    stats = gradckpt.shape_stats(model)
    assert stats.replans == 0 and stats.switches == 0, stats.summary()
    assert [route for _, route in stats.routes] == ["fitted"]
    # A call that really differs is still a new shape.
    model(input_ids=ids[:, :32], labels=ids[:, :32]).loss.backward()
    assert gradckpt.shape_stats(model).replans == 1
