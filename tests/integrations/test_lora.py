"""Frozen base, trainable adapters: adapter gradients survive every way of checkpointing.

The LoRA adapters are written by hand (no PEFT). The base, embeddings included,
is frozen, so nothing entering a layer requires grad: the case in which torch's
reentrant checkpoint silently drops the gradients (pytorch#7617) and transformers
needs ``enable_input_require_grads()``. gradckpt is non-reentrant, so adapter
gradients must equal the plain run's exactly: per-layer ``gradckpt.checkpoint``,
a fitted plan, a plan with multi-layer segments, and transformers' own switch.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import gradckpt
from gradckpt.integrations import hf
from gradckpt.integrations.hf.zoo import hf_example, run_step
from gradckpt.planning import Plan, Segment, UnitChoice, iter_units
from gradckpt.profiling import model_fingerprint

TARGETS = ("q_proj", "v_proj", "c_attn")  # Llama's query/value, GPT-2's fused qkv (Conv1D)
BUDGET = 0.85


class LoRA(nn.Module):
    """``base(x) + scale * B(A(dropout(x)))`` with ``base`` frozen."""

    def __init__(self, base: nn.Module, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        weight = base.weight
        # nn.Linear stores (out, in); transformers' Conv1D (GPT-2) stores (in, out).
        d_in, d_out = (
            (base.in_features, base.out_features)
            if isinstance(base, nn.Linear)
            else tuple(weight.shape)
        )
        self.base = base
        self.drop = nn.Dropout(0.1)
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.b.weight, std=0.02)  # not zero: A gets a gradient at step one too
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.b(self.a(self.drop(x)))


def _lora_example(name: str):
    ex = hf_example(name, layers=3)
    hf.disable_cache(ex.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        for p in ex.model.parameters():
            p.requires_grad_(False)
        for path, module in list(ex.model.named_modules()):
            if path.rsplit(".", 1)[-1] in TARGETS:
                parent, _, child = path.rpartition(".")
                setattr(ex.model.get_submodule(parent), child, LoRA(module))
    return ex


def _adapters(step) -> dict[str, torch.Tensor]:
    return {k: g for k, g in step.grads.items() if ".a.weight" in k or ".b.weight" in k}


def _assert_adapter_grads_equal(step, plain, model: nn.Module) -> None:
    got, want = _adapters(step), _adapters(plain)
    assert len(want) == 2 * sum(isinstance(m, LoRA) for m in model.modules())
    assert got.keys() == want.keys() == set(step.grads)  # the base got nothing
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _wrap_layers(model: nn.Module, paths: list[str], run) -> None:
    for path in paths:
        layer = model.get_submodule(path)
        layer.forward = functools.partial(run, layer.forward)


def _unwrap_layers(model: nn.Module, paths: list[str]) -> None:
    for path in paths:
        del model.get_submodule(path).forward


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=["llama", "gpt2"])
def lora(request):
    ex = _lora_example(request.param)
    return ex, run_step(ex)


def test_nothing_entering_a_layer_requires_grad(lora):
    ex, plain = lora
    seen = []
    hook = ex.model.get_submodule(ex.block_paths[0]).register_forward_pre_hook(
        lambda module, args: seen.append(args[0].requires_grad)
    )
    ex.loss_fn()
    hook.remove()
    assert seen == [False]
    adapters = _adapters(plain)
    assert adapters and all(g.abs().sum() > 0 for g in adapters.values())


def test_torch_reentrant_checkpoint_loses_them(lora):
    """The failure gradckpt avoids (pytorch#7617): every layer's output is cut off."""
    ex, _ = lora

    def reentrant(forward, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(
            functools.partial(forward, **kwargs), *args, use_reentrant=True
        )

    _wrap_layers(ex.model, ex.block_paths, reentrant)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "None of the inputs have requires_grad=True"
            loss = ex.loss_fn()
        assert not loss.requires_grad  # so backward() raises, or the adapters get nothing
    finally:
        _unwrap_layers(ex.model, ex.block_paths)


def test_gradckpt_checkpoint_per_layer(lora):
    ex, plain = lora

    def run(forward, *args, **kwargs):
        return gradckpt.checkpoint(forward, *args, **kwargs)

    _wrap_layers(ex.model, ex.block_paths, run)
    try:
        step = run_step(ex)
    finally:
        _unwrap_layers(ex.model, ex.block_paths)
    _assert_adapter_grads_equal(step, plain, ex.model)
    assert step.peak_bytes < plain.peak_bytes


def test_fitted_plan(lora):
    ex, plain = lora
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget=BUDGET, profiling=gradckpt.ProfileOptions(repeats=1))
    step = run_step(ex)
    gradckpt.remove(ex.model)
    # A block is checkpointed: recomputed or selective, or inside a segment
    # (fit may pick a segment plan, whose units read "keep").
    segmented = {u.path for i in plan.items if isinstance(i, Segment) for u in iter_units(i.items)}
    assert any(
        u.mode != "keep" or u.path in segmented for u in plan.units if u.path in ex.block_paths
    )
    _assert_adapter_grads_equal(step, plain, ex.model)
    assert step.peak_bytes <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - step.peak_bytes) <= 0.05 * step.peak_bytes


def test_plan_with_a_segment_over_all_layers(lora):
    ex, plain = lora
    layers = ex.block_paths
    inner = (*(UnitChoice(p, "recompute") for p in layers[:-1]), UnitChoice(layers[-1]))
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    items: list = []
    for unit in prof.units:
        if unit.path == layers[0]:
            items.append(Segment(inner))
        elif unit.path not in layers:
            items.append(UnitChoice(unit.path))
    plan = Plan(tuple(items), model_fingerprint(ex.model))
    gradckpt.apply(ex.model, plan)
    step = run_step(ex)
    gradckpt.remove(ex.model)
    _assert_adapter_grads_equal(step, plain, ex.model)
    assert step.peak_bytes < plain.peak_bytes
    predicted = gradckpt.simulate(prof, plan).peak_bytes
    assert abs(predicted - step.peak_bytes) <= 0.05 * step.peak_bytes


def test_transformers_switch(lora):
    ex, plain = lora
    hf.enable(ex.model)
    step = run_step(ex)
    hf.disable(ex.model)
    # No enable_input_require_grads() hook was needed for the gradients to flow.
    assert not getattr(ex.model, "_require_grads_hooks", None)
    _assert_adapter_grads_equal(step, plain, ex.model)
    assert step.peak_bytes < plain.peak_bytes
