"""Re-planning models that cannot run under fake tensors: transformers' Mixtral and Qwen2-MoE
in fp32 (the fake ``grouped_mm`` kernel demands bf16 where the CPU kernel does not) and
DeBERTa-v2 (its loss calls ``nonzero()``). A new sequence length after ``fit`` must train
under every ``on_new_shape`` mode without an exception out of the user's forward: planned
from one real step under the leanest plan ("real-frugal", within the budget at the
allocator), or run under the old plan with a warning giving its peak ("old-plan")."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

import gradckpt
from gradckpt.measure import AllocatorTracker, state_bytes

transformers = pytest.importorskip("transformers")

FITTED, LONGER = 32, (48, 64)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one thread is ~3x faster than two contending on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(name):
    torch.manual_seed(0)
    common = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    if name == "mixtral":
        config = transformers.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            attention_dropout=0.1,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
    elif name == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, attention_dropout=0.1,
        )  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        config = transformers.DebertaV2Config(**common, hidden_dropout_prob=0.1)
        model = transformers.DebertaV2ForMaskedLM(config)
    model.config.use_cache = False  # as fit sets it; the plain twin runs the same ops
    return model.train()


def _batch(length):
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def _step(model, batch, seed):
    """(whole peak at the allocator, gradients) of one step from a fixed seed."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with AllocatorTracker() as allocator:
        model(**batch).loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return state_bytes(model) + allocator.peak_bytes, grads


@functools.cache
def _budget(name):
    """Just under the plain step at 48: the fitted length runs plainly, both longer ones
    need plans (their leanest ones fit)."""
    peak, _ = _step(_model(name), _batch(LONGER[0]), 0)
    return int(peak * 0.97)


@functools.cache
def _profile(name):
    """The fitted step's real profile, measured once per model (each test's fit reuses it)."""
    model, batch = _model(name), _batch(FITTED)
    return gradckpt.profile(model, lambda: model(**batch).loss, repeats=1)


def _fit(name, **options):
    model = _model(name)
    plain = copy.deepcopy(model)
    batch = _batch(FITTED)
    gradckpt.fit(
        model, lambda: model(**batch).loss, _budget(name), profiling=gradckpt.ProfileOptions(profile=_profile(name)),
        measure_candidates=0, chunking=False, **options,  # bit for bit: no other order of sums
    )  # fmt: skip
    return model, plain


def _same(grads, plain_grads):
    assert grads.keys() == plain_grads.keys()
    return all(torch.equal(grads[k], plain_grads[k]) for k in grads)


MODELS = ["mixtral", "qwen2_moe", "deberta_v2"]


@pytest.mark.parametrize("name", MODELS)
def test_replan_falls_back_to_a_real_step_and_holds_the_budget(name):
    model, plain = _fit(name)
    budget = _budget(name)
    for seed, length in enumerate((*LONGER, FITTED)):
        peak, grads = _step(model, _batch(length), seed)
        plain_peak, plain_grads = _step(plain, _batch(length), seed)
        assert peak <= budget, (length, peak, budget)
        assert (plain_peak > budget) == (length != FITTED)  # longer: only a plan fits
        assert _same(grads, plain_grads), length
    stats = gradckpt.shape_stats(model)
    routes = dict(stats.routes)
    assert sorted(routes.values()) == ["fitted", "real-frugal", "real-frugal"], routes
    assert stats.replans == 2 and stats.switches == 3


@pytest.mark.parametrize("name", MODELS)
def test_warn_runs_the_old_plan_with_its_measured_peak_in_the_warning(name):
    model, plain = _fit(name, on_new_shape="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peak, grads = _step(model, _batch(LONGER[-1]), 1)
    said = [str(w.message) for w in caught if "on_new_shape='warn'" in str(w.message)]
    assert len(said) == 1
    # The peak the warning gives is the old plan's, measured on a real step at the shape.
    number, unit = said[0].split("at this shape is ")[1].split(" ")[:2]
    predicted = float(number) * {"B,": 1, "KiB,": 2**10, "MiB,": 2**20}[unit]
    assert abs(predicted - peak) <= 0.02 * peak, (said[0], peak)
    assert _same(grads, _step(plain, _batch(LONGER[-1]), 1)[1])
    assert [route for _, route in gradckpt.shape_stats(model).routes] == ["fitted", "old-plan"]


@pytest.mark.parametrize("name", MODELS)
def test_shapes_planned_at_fit_take_the_real_route_and_hold_the_budget(name):
    model, plain = _fit(name, shapes=list(LONGER), on_new_shape="error")
    routes = dict(gradckpt.shape_stats(model).routes)
    assert sorted(routes.values()) == ["fitted", "real-frugal", "real-frugal"], routes
    for seed, length in enumerate(LONGER):
        peak, grads = _step(model, _batch(length), seed)
        assert peak <= _budget(name), (length, peak)
        assert _same(grads, _step(plain, _batch(length), seed)[1])
    assert gradckpt.shape_stats(model).replans == 0  # planned at fit, switched to
