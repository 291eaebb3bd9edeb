"""Checklist items 1-4, 6-8, 11-12, 21-23 and argument validation (frameworks.md §3).

Each test compares ``gradckpt.checkpoint`` with the plain run from the same seed
(dropout on), and where torch's non-reentrant checkpoint is the reference, with it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

import gradckpt
from gradckpt.engine import in_region_forward


class Counted(nn.Module):
    """Wraps a module and counts its forward calls."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


# ----------------------------------------------------------------- item 1


def test_item01_sequential_outputs_and_grads_equal_plain(step, same, make_model, mlp_factory):
    model = make_model(mlp_factory)
    x = torch.randn(5, 8, requires_grad=True)
    plain = step(model, model, x)
    ours = step(model, lambda x: gradckpt.checkpoint(model, x), x)
    torch_ref = step(model, lambda x: torch_checkpoint(model, x, use_reentrant=False), x)
    same(ours, plain)
    same(torch_ref, plain)
    assert all(g is not None for g in ours["param_grads"])


def test_item01_checkpoint_sequential_equals_plain_and_torch(step, same, make_model, mlp_factory):
    model = make_model(mlp_factory)
    x = torch.randn(5, 8, requires_grad=True)
    plain = step(model, model, x)
    for segments in (1, 2, 3, len(model)):
        ours = step(model, lambda x, s=segments: gradckpt.checkpoint_sequential(model, s, x), x)
        same(ours, plain)
    torch_ref = step(
        model, lambda x: torch_checkpoint_sequential(model, 3, x, use_reentrant=False), x
    )
    same(torch_ref, plain)


def test_item01_module_list_equals_plain(step, same, make_model, mlp_factory):
    model = make_model(lambda: nn.ModuleList(mlp_factory()))

    def forward(x, layers):
        for layer in layers:
            x = layer(x)
        return x

    x = torch.randn(5, 8, requires_grad=True)
    plain = step(model, lambda x: forward(x, model), x)
    ours = step(model, lambda x: gradckpt.checkpoint(forward, x, model), x)
    per_layer = step(
        model,
        lambda x: forward(x, [lambda h, m=m: gradckpt.checkpoint(m, h) for m in model]),
        x,
    )
    same(ours, plain)
    same(per_layer, plain)


def test_item01_plain_list_of_modules_equals_plain(step, same, make_model, mlp_factory):
    holder = make_model(mlp_factory)
    layers = list(holder)  # a plain Python list, not a container module
    x = torch.randn(5, 8, requires_grad=True)

    def plain_forward(x):
        for layer in layers:
            x = layer(x)
        return x

    plain = step(holder, plain_forward, x)
    ours = step(holder, lambda x: gradckpt.checkpoint_sequential(layers, 2, x), x)
    same(ours, plain)


# ----------------------------------------------------------------- item 2


@pytest.mark.parametrize(("n_modules", "segments"), [(4, 2), (6, 3), (4, 4)])
def test_item02_checkpoint_sequential_reruns_all_but_last_segment(n_modules, segments):
    torch.manual_seed(0)
    modules = [Counted(nn.Sequential(nn.Linear(4, 4), nn.Tanh())) for _ in range(n_modules)]
    x = torch.randn(3, 4, requires_grad=True)
    out = gradckpt.checkpoint_sequential(nn.Sequential(*modules), segments, x)
    assert [m.calls for m in modules] == [1] * n_modules
    out.sum().backward()
    last = n_modules - n_modules // segments
    assert [m.calls for m in modules] == [2] * last + [1] * (n_modules - last)


# ----------------------------------------------------------------- item 3


def test_item03_checkpoint_sequential_rejects_zero_or_several_inputs():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError):
        gradckpt.checkpoint_sequential(model, 1)
    with pytest.raises(TypeError):
        gradckpt.checkpoint_sequential(model, 1, x, x)
    with pytest.raises(TypeError, match="exactly one tensor input"):
        gradckpt.checkpoint_sequential(model, 1, (x, x))
    with pytest.raises(TypeError, match="exactly one tensor input"):
        gradckpt.checkpoint_sequential(model, 1, None)


# ----------------------------------------------------------------- item 4


def test_item04_no_warning_when_use_reentrant_is_omitted_or_false():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradckpt.checkpoint(lin, x).sum().backward()
        gradckpt.checkpoint(lin, x, use_reentrant=False).sum().backward()
        gradckpt.checkpoint_sequential(nn.Sequential(lin, nn.Tanh()), 2, x).sum().backward()
    assert x.grad is not None


def test_item04_use_reentrant_true_is_rejected():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant"):
        gradckpt.checkpoint(torch.sin, x, use_reentrant=True)


# ----------------------------------------------------------------- item 6


def test_item06_kwargs_tensors_get_grads():
    def fn(x, *, scale, extras):
        return (x * scale).sin() + extras["shift"].cos() * x

    def make():
        torch.manual_seed(3)
        return (
            torch.randn(4, requires_grad=True),
            torch.randn(4, requires_grad=True),
            torch.randn(4, requires_grad=True),
        )

    results = []
    for call in (
        lambda f, x, **kw: f(x, **kw),
        lambda f, x, **kw: gradckpt.checkpoint(f, x, **kw),
        lambda f, x, **kw: torch_checkpoint(f, x, use_reentrant=False, **kw),
    ):
        x, scale, shift = make()
        call(fn, x, scale=scale, extras={"shift": shift}).sum().backward()
        results.append((x.grad, scale.grad, shift.grad))
    plain, ours, torch_ref = results
    assert all(g is not None for g in ours)
    for a, b, c in zip(plain, ours, torch_ref):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


# ----------------------------------------------------------------- item 7


def test_item07_non_tensor_inputs_and_outputs_come_back_unchanged():
    marker = object()

    def fn(x, none, n, s, flag, obj):
        assert none is None and n == 3 and s == "text" and flag is True and obj is marker
        return x.sin() * n, None, n, s, flag, obj

    x = torch.randn(4, requires_grad=True)
    out = gradckpt.checkpoint(fn, x, None, 3, "text", True, marker)
    assert out[1:] == (None, 3, "text", True, marker)
    assert out[5] is marker
    out[0].sum().backward()  # the recompute sees the same non-tensor inputs (fn asserts)
    assert torch.equal(x.grad, (x.detach().cos() * 3))


def test_item07_function_without_tensors():
    calls = []

    def fn(a, b, label):
        calls.append(1)
        return a + b, label

    assert gradckpt.checkpoint(fn, 1, 2, "sum") == (3, "sum")
    assert gradckpt.checkpoint(lambda: None) is None
    assert len(calls) == 1


# ----------------------------------------------------------------- item 8


def test_item08_identity_output_accumulates_grads():
    def identity_and_double(x):
        return x, x * 2

    results = []
    for call in (
        lambda f, x: f(x),
        lambda f, x: gradckpt.checkpoint(f, x),
        lambda f, x: torch_checkpoint(f, x, use_reentrant=False),
    ):
        leaf = torch.arange(4.0, requires_grad=True)
        x = leaf * 1.5
        ident, double = call(identity_and_double, x)
        (ident * ident + double).sum().backward()
        results.append((ident.detach(), leaf.grad))
    plain, ours, torch_ref = results
    assert torch.equal(ours[0], plain[0]) and torch.equal(ours[1], plain[1])
    assert torch.equal(torch_ref[1], plain[1])

    x = torch.randn(3, requires_grad=True)
    y = gradckpt.checkpoint(lambda t: t, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


# ----------------------------------------------------------------- item 11


def test_item11_frozen_input_params_still_get_grads(step, same, make_model, mlp_factory):
    model = make_model(mlp_factory)
    x = torch.randn(5, 8)  # requires_grad=False, as for embeddings of a frozen base model
    plain = step(model, model, x)
    ours = step(model, lambda x: gradckpt.checkpoint(model, x), x)
    same(ours, plain)
    assert all(g is not None for g in ours["param_grads"])


def test_item11_torch_reentrant_loses_param_grads_we_do_not():
    """Documents the improvement over pytorch#7617."""
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        out = torch_checkpoint(lin, x, use_reentrant=True)
    assert not out.requires_grad
    out = gradckpt.checkpoint(lin, x)
    assert out.requires_grad
    out.sum().backward()
    assert lin.weight.grad is not None


# ----------------------------------------------------------------- item 12


def test_item12_tensors_inside_containers_get_grads():
    def fn(batch):
        a, (b, c) = batch["a"], batch["pair"]
        return (a.sin() * b + c.exp()).sum(0)

    def make():
        torch.manual_seed(4)
        return [torch.randn(3, 2, requires_grad=True) for _ in range(3)]

    grads = []
    for call in (
        lambda f, d: f(d),
        lambda f, d: gradckpt.checkpoint(f, d),
        lambda f, d: torch_checkpoint(f, d, use_reentrant=False),
    ):
        a, b, c = make()
        call(fn, {"a": a, "pair": [b, c]}).sum().backward()
        grads.append([a.grad, b.grad, c.grad])
    plain, ours, torch_ref = grads
    for p, o, t in zip(plain, ours, torch_ref):
        assert o is not None and torch.equal(p, o) and torch.equal(p, t)


# ----------------------------------------------------------------- item 21


def test_item21_under_no_grad_no_region_and_outputs_do_not_require_grad():
    seen = []

    def fn(x):
        seen.append(in_region_forward())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = gradckpt.checkpoint(fn, x)
    assert not out.requires_grad
    assert seen == [False]  # ran once, plainly, outside any region


# ----------------------------------------------------------------- item 22


def test_item22_no_grad_and_detach_inside_keep_eager_requires_grad():
    def fn(x):
        detached = x.detach() * 2
        with torch.no_grad():
            no_grad = x * 3
        return detached, no_grad, x * 4

    x = torch.randn(3, requires_grad=True)
    eager = [t.requires_grad for t in fn(x)]
    ours = gradckpt.checkpoint(fn, x)
    assert [t.requires_grad for t in ours] == eager == [False, False, True]
    ours[2].sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 4.0))


# ----------------------------------------------------------------- item 23


def test_item23_function_runs_twice_per_step_and_once_under_no_grad():
    calls = []

    def fn(x):
        calls.append(torch.is_grad_enabled())
        return x.sin().cos()

    x = torch.randn(3, requires_grad=True)
    out = gradckpt.checkpoint(fn, x)
    assert len(calls) == 1
    out.sum().backward()
    assert calls == [True, True]

    calls.clear()
    with torch.no_grad():
        gradckpt.checkpoint(fn, x)
    assert calls == [False]


# ------------------------------------------------------------ validation


def test_non_callable_fn_raises_type_error():
    with pytest.raises(TypeError, match="callable"):
        gradckpt.checkpoint(torch.randn(2), torch.randn(2))


def test_non_callable_policy_raises_type_error():
    with pytest.raises(TypeError, match="policy must be a callable"):
        gradckpt.checkpoint(torch.sin, torch.randn(2, requires_grad=True), policy="save_all")


@pytest.mark.parametrize("segments", [0, -1, 3])
def test_checkpoint_sequential_segments_out_of_range(segments):
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with pytest.raises(ValueError, match="segments must be between 1"):
        gradckpt.checkpoint_sequential(model, segments, torch.randn(1, 2))


def test_checkpoint_sequential_segments_must_be_int():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with pytest.raises(TypeError, match="segments must be an int"):
        gradckpt.checkpoint_sequential(model, 1.5, torch.randn(1, 2))
