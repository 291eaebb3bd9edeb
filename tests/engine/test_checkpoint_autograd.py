"""Checklist items 5, 9, 10, 24, 25, 28, 29, 32, 33: autograd interplay (frameworks.md §3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt


def _plain(fn, *args):
    return fn(*args)


def _ours(fn, *args, **kwargs):
    return gradckpt.checkpoint(fn, *args, **kwargs)


def _torch(fn, *args, **kwargs):
    return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _block(x, w):
    return torch.tanh(x @ w).sin() * x


def _leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_()
    return x, w


# ----------------------------------------------------------------- item 5


def test_item05_autograd_grad_matches_eager_and_torch():
    results = []
    for call in (_plain, _ours, _torch):
        x, w = _leaves()
        out = call(_block, x, w)
        results.append(torch.autograd.grad(out.sum(), (x, w)))
    plain, ours, torch_ref = results
    for p, o, t in zip(plain, ours, torch_ref):
        assert torch.equal(p, o) and torch.equal(p, t)


def test_item05_backward_inputs_matches_eager_and_leaves_others_alone():
    results = []
    for call in (_plain, _ours, _torch):
        x, w = _leaves()
        call(_block, x, w).sum().backward(inputs=[w])
        assert x.grad is None
        results.append(w.grad)
    plain, ours, torch_ref = results
    assert torch.equal(plain, ours) and torch.equal(plain, torch_ref)


# ----------------------------------------------------------------- item 9


def _two_heads(x, w):
    h = torch.tanh(x @ w)
    return h.sin(), h.cos() * x, (h * h).exp()


@pytest.mark.parametrize("call", [_plain, _ours], ids=["plain", "ours"])
def test_item09_partial_backward_then_third_backward_raises(call):
    x, w = _leaves()
    a, b, _ = call(_two_heads, x, w)
    a.sum().backward(retain_graph=True)
    after_a = (x.grad.clone(), w.grad.clone())
    b.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        a.sum().backward()
    # compare with the plain run, reference computed here from scratch
    xr, wr = _leaves()
    ar, br, _ = _two_heads(xr, wr)
    ga = torch.autograd.grad(ar.sum(), (xr, wr), retain_graph=True)
    gb = torch.autograd.grad(br.sum(), (xr, wr))
    assert torch.equal(after_a[0], ga[0]) and torch.equal(after_a[1], ga[1])
    assert torch.allclose(x.grad, ga[0] + gb[0], rtol=0, atol=1e-15)
    assert torch.allclose(w.grad, ga[1] + gb[1], rtol=0, atol=1e-15)


# ----------------------------------------------------------------- item 10


def test_item10_no_output_requires_grad_behaves_like_eager():
    """Reentrant torch raises its own error here; we follow eager exactly."""
    lin = nn.Linear(3, 3).requires_grad_(False)
    x = torch.randn(2, 3)
    out = gradckpt.checkpoint(lin, x)
    assert not out.requires_grad and out.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="does not require grad"):
        lin(x).sum().backward()


# ----------------------------------------------------------------- item 24


def _early_stop_fn(calls):
    def fn(x, w):
        calls["start"] += 1
        h = torch.tanh(x @ w)  # saves x, w and tanh's output: the last saved tensor
        calls["after_last_save"] += 1
        return h + 1, (h * 2).clone()  # add, scalar mul and clone save nothing

    return fn


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("reference", [False, True], ids=["ours", "torch"])
def test_item24_early_stop_skips_the_tail_unless_disabled(early_stop, reference):
    calls = {"start": 0, "after_last_save": 0}
    fn = _early_stop_fn(calls)
    x, w = _leaves()
    if reference:
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            a, b = _torch(fn, x, w)
    else:
        a, b = _ours(fn, x, w, early_stop=early_stop)
    (a + b).sum().backward()
    assert calls == {"start": 2, "after_last_save": 1 if early_stop else 2}
    xr, wr = _leaves()
    ar, br = _early_stop_fn({"start": 0, "after_last_save": 0})(xr, wr)
    (ar + br).sum().backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)


# ----------------------------------------------------------------- item 25


@pytest.mark.parametrize("retain_graph", [False, True])
def test_item25_recomputed_buffers_freed_as_soon_as_unpacked(retain_graph):
    """Each recomputed activation dies right after the backward node that used it."""
    recomputed: list[StorageWeakRef] = []
    snapshots: list[list[bool]] = []
    phase = {"forward": True}

    def fn(x):
        h = x
        for i in range(4):  # sin saves its input: x, h1, h2, h3
            if i > 0 and phase["forward"]:
                h.register_hook(lambda g: snapshots.append([not r.expired() for r in recomputed]))
            elif i > 0:
                recomputed.append(StorageWeakRef(h.untyped_storage()))
            h = h.sin()
        return h

    x = torch.randn(16, requires_grad=True)
    out = gradckpt.checkpoint(fn, x)
    phase["forward"] = False
    out.sum().backward(retain_graph=retain_graph)
    assert len(recomputed) == 3
    # Hooks fire for h3, h2, h1 (grads flow backwards); when h_k's hook fires, the
    # node that consumed h_k has run, so the recomputed h_k is already freed.
    assert snapshots == [[True, True, False], [True, False, False], [False, False, False]]
    assert all(ref.expired() for ref in recomputed)


def test_item25_partial_backward_leaves_no_recomputed_tensors_behind():
    """A retain_graph backward through one branch recomputes the other branch's
    saved tensors too (the region reruns as a whole); they must not outlive it."""
    recomputed: list[StorageWeakRef] = []
    phase = {"forward": True}

    def fn(x):
        a = x.sin()
        b = x.exp()  # exp saves its output; only the second output needs it
        if not phase["forward"]:
            recomputed.append(StorageWeakRef(b.untyped_storage()))
        return a, b.cos()

    x = torch.randn(64, requires_grad=True)
    a, c = gradckpt.checkpoint(fn, x)
    phase["forward"] = False
    for _ in range(3):
        a.sum().backward(retain_graph=True)
    assert len(recomputed) == 3
    assert all(ref.expired() for ref in recomputed)
    c.sum().backward()  # the other branch still works afterwards
    assert torch.allclose(x.grad, 3 * x.detach().cos() - x.detach().exp().sin() * x.detach().exp())


# ----------------------------------------------------------------- item 28


def _grad_inside_then_use(x):
    y = x.sin()
    z = y.cos()
    (gx,) = torch.autograd.grad(z.sum(), x, create_graph=True)
    return x.cos() * gx


def _grad_inside_retain(x):
    y = x.sin()
    z = y.cos()
    (gx,) = torch.autograd.grad(z.sum(), x, retain_graph=True)
    return gx * z


@pytest.mark.parametrize("fn", [_grad_inside_then_use, _grad_inside_retain])
@pytest.mark.parametrize("early_stop", [True, False])
def test_item28_backward_inside_the_region_matches_eager(fn, early_stop):
    results = []
    for call in (_plain, lambda f, x: _ours(f, x, early_stop=early_stop)):
        x, _ = _leaves()
        out = call(fn, x)
        out.sum().backward()
        results.append((out.detach(), x.grad))
    (po, pg), (oo, og) = results
    assert torch.allclose(po, oo, rtol=0, atol=1e-15)
    assert torch.allclose(pg, og, rtol=0, atol=1e-15)


# ----------------------------------------------------------------- item 29


def test_item29_second_backward_recomputes_again_and_accumulates():
    calls = []

    def fn(x, w):
        calls.append(1)
        return _block(x, w)

    x, w = _leaves()
    out = _ours(fn, x, w)
    out.sum().backward(retain_graph=True)
    first = (x.grad.clone(), w.grad.clone())
    out.sum().backward()
    assert len(calls) == 3  # forward, then one recompute per backward pass
    xr, wr = _leaves()
    _block(xr, wr).sum().backward()
    assert torch.equal(first[0], xr.grad) and torch.equal(first[1], wr.grad)
    assert torch.equal(x.grad, 2 * xr.grad) and torch.equal(w.grad, 2 * wr.grad)


# ----------------------------------------------------------------- item 32


@pytest.mark.parametrize("call", [_plain, _ours, _torch], ids=["plain", "ours", "torch"])
def test_item32_inplace_change_of_saved_input_is_caught(call):
    x, w = _leaves()
    h = x * 1.0  # non-leaf, so it may be changed in place
    out = call(_block, h, w)
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ----------------------------------------------------------------- item 33


def test_item33_double_backward_matches_eager():
    results = []
    for call in (_plain, _ours, _torch):
        x, w = _leaves()
        out = call(_block, x, w)
        gx, gw = torch.autograd.grad(out.sum(), (x, w), create_graph=True)
        (gx.pow(2).sum() + gw.sin().sum()).backward()
        results.append((gx.detach(), x.grad, w.grad))
    plain, ours, torch_ref = results
    for p, o, t in zip(plain, ours, torch_ref):
        assert torch.allclose(p, o, rtol=0, atol=1e-14)
        assert torch.allclose(p, t, rtol=0, atol=1e-14)
