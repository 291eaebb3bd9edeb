"""remove() gives a fitted transformers model back as it was; its saved config is the user's."""

from __future__ import annotations

import json
import warnings

import pytest

import gradckpt

pytest.importorskip("transformers")
from gradckpt.integrations.hf.zoo import hf_example


def _fit(ex):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gradckpt.fit(ex.model, ex.loss_fn, budget=0.9, profiling=gradckpt.ProfileOptions(repeats=1))


def _cache_settings(model):
    """use_cache of every config the model's modules hold (T5's stacks hold copies)."""
    return [getattr(m.config, "use_cache", None) for m in model.modules() if hasattr(m, "config")]


def _cache(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_remove_restores_use_cache_and_save_pretrained_keeps_the_users_value(name, tmp_path):
    ex = hf_example(name, layers=2)
    assert ex.model.config.use_cache is True
    before = _cache_settings(ex.model)
    _fit(ex)
    assert _cache(ex.model(**ex.inputs)) is None  # training steps build no KV cache
    ex.model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True
    gradckpt.remove(ex.model)
    assert _cache_settings(ex.model) == before
    assert _cache(ex.model(**ex.inputs)) is not None  # the plain model caches again


def test_a_second_fit_keeps_the_cache_off_and_one_remove_restores_it():
    ex = hf_example("gpt2", layers=2)
    _fit(ex)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gradckpt.fit(ex.model, ex.loss_fn, budget=0.95, profiling=gradckpt.ProfileOptions(repeats=1))
    assert _cache(ex.model(**ex.inputs)) is None
    gradckpt.remove(ex.model)
    assert _cache(ex.model(**ex.inputs)) is not None
    assert not ex.model._forward_pre_hooks


def test_deepcopy_of_a_fitted_gpt2_trains_the_copy():
    """A reference or EMA model made with deepcopy after fit: its own weights get the gradients."""
    import copy

    import torch

    ex = hf_example("gpt2", layers=2)
    plain = copy.deepcopy(ex.model)
    torch.manual_seed(1)
    plain(**ex.inputs).loss.backward()
    _fit(ex)
    twin = copy.deepcopy(ex.model)
    torch.manual_seed(1)
    twin(**ex.inputs).loss.backward()
    assert all(p.grad is None for p in ex.model.parameters())
    grads = dict(twin.named_parameters())
    assert all(torch.equal(p.grad, grads[k].grad) for k, p in plain.named_parameters())
    gradckpt.remove(twin)
    assert _cache(twin(**ex.inputs)) is not None  # the copy's own no-cache hook went too
    gradckpt.remove(ex.model)
