"""Checklist items 13-20: RNG, autocast and device-context replay (frameworks.md §3)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine import state as engine_state


def _dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 16), nn.Dropout(0.5), nn.GELU(), nn.Linear(16, 16), nn.Dropout(0.5)
    )


# ---------------------------------------------------------------- item 13


def test_item13_cpu_dropout_mask_replayed_grads_equal_plain(step, same):
    model = _dropout_model()
    x = torch.randn(4, 16, requires_grad=True)
    plain = step(model, model, x, seed=7)
    ours = step(model, lambda x: gradckpt.checkpoint(model, x), x, seed=7)
    same(ours, plain)
    assert (plain["out"] == 0).any()  # dropout really dropped something


def test_item13_rng_replayed_for_random_factories_too():
    def fn(x):
        return x * torch.rand_like(x) + torch.randn(x.shape) * x.sin()

    x = torch.randn(32, requires_grad=True)
    torch.manual_seed(5)
    fn(x).sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(5)
    gradckpt.checkpoint(fn, x).sum().backward()
    assert torch.equal(x.grad, plain)


# ---------------------------------------------------------------- item 14


def test_item14_device_inferred_from_tensors_nested_in_containers(monkeypatch):
    """No second device here; what we can check on CPU is that nested tensors are seen."""
    seen = []
    real = engine_state.infer_device_type

    def spy(tensors):
        tensors = list(tensors)
        seen.append([t.device.type for t in tensors])
        return real(tensors)

    monkeypatch.setattr(engine_state, "infer_device_type", spy)
    x = torch.randn(2, requires_grad=True)
    m = torch.randn(2, device="meta")
    gradckpt.checkpoint(lambda d: d["cpu"][0].sin(), {"cpu": [x], "deep": ({"m": m},)})
    assert seen == [["cpu", "meta"]]
    assert real([x, m]) == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device RNG replay needs CUDA")
def test_item14_cuda_dropout_replayed_for_inputs_nested_in_containers():
    model = _dropout_model().cuda()
    x = torch.randn(4, 16, device="cuda", requires_grad=True)

    def fn(batch):
        return model(batch["x"][0])

    grads = []
    for use_ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)  # seeds the CUDA generators too
        out = gradckpt.checkpoint(fn, {"x": [x]}) if use_ckpt else fn({"x": [x]})
        out.sum().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------- item 15


def test_item15_no_rng_preservation_runs_and_masks_differ(step):
    model = _dropout_model()
    x = torch.randn(4, 16, requires_grad=True)
    plain = step(model, model, x, seed=7)
    free = step(model, lambda x: gradckpt.checkpoint(model, x, preserve_rng_state=False), x, seed=7)
    assert torch.equal(free["out"], plain["out"])  # the forward itself is untouched
    # The recompute draws fresh masks (RNG has advanced since the forward), so
    # backward uses masks that do not match the forward's: grads differ.
    assert not torch.equal(free["param_grads"][0], plain["param_grads"][0])
    assert all(torch.isfinite(g).all() for g in free["param_grads"])


# ---------------------------------------------------------------- item 16


@pytest.mark.parametrize("policy", [None, gradckpt.policies.save_matmuls])
def test_item16_caller_rng_stream_after_backward_equals_plain(policy):
    model = _dropout_model()
    x = torch.randn(4, 16, requires_grad=True)
    streams = []
    for use_ckpt in (False, True):
        torch.manual_seed(11)
        out = gradckpt.checkpoint(model, x, policy=policy) if use_ckpt else model(x)
        between = torch.rand(3)  # the caller draws between forward and backward
        out.sum().backward()
        streams.append((between, torch.get_rng_state(), torch.rand(3)))
    (pb, ps, pa), (ob, os_, oa) = streams
    assert torch.equal(pb, ob)
    assert torch.equal(ps, os_)  # the recompute's dropout draws did not move the stream
    assert torch.equal(pa, oa)


def test_item16_caller_rng_stream_preserved_when_an_input_is_on_meta():
    """A meta tensor among the inputs makes the region's device type "meta"."""

    def fn(x, shape_carrier):
        return torch.nn.functional.dropout(x.sin(), 0.5) * shape_carrier.numel()

    x = torch.randn(8, requires_grad=True)
    carrier = torch.empty(2, device="meta")
    streams, grads = [], []
    for use_ckpt in (False, True):
        x.grad = None
        torch.manual_seed(11)
        out = gradckpt.checkpoint(fn, x, carrier) if use_ckpt else fn(x, carrier)
        torch.rand(3)  # the caller draws between forward and backward
        out.sum().backward()
        streams.append(torch.rand(3))
        grads.append(x.grad)
    assert torch.equal(streams[0], streams[1])
    assert torch.equal(grads[0], grads[1])  # and the dropout mask was replayed


# ---------------------------------------------------------------- item 17


def test_item17_cpu_autocast_replayed_in_recompute():
    model = _dropout_model()
    x = torch.randn(4, 16, requires_grad=True)
    results = []
    for use_ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = gradckpt.checkpoint(model, x) if use_ckpt else model(x)
        out.float().sum().backward()  # backward (and so the recompute) outside autocast
        results.append((out, [p.grad for p in model.parameters()], x.grad))
    (p_out, p_grads, p_xg), (o_out, o_grads, o_xg) = results
    assert o_out.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in o_grads)
    # bf16 tolerance, although the replayed computation should in fact be identical
    tol = {"rtol": 1.6e-2, "atol": 1e-5}
    assert torch.allclose(o_out.float(), p_out.float(), **tol)
    for a, b in zip(o_grads, p_grads):
        assert torch.allclose(a, b, **tol)
    assert torch.allclose(o_xg, p_xg, **tol)


def test_item17_backward_under_autocast_disabled_still_replays_bf16():
    """Without replay the recompute would save fp32 where the forward saved bf16
    and the determinism check would raise."""
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gradckpt.checkpoint(lambda t: lin(t).relu(), x)
    with torch.autocast("cpu", enabled=False):
        out.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


# ---------------------------------------------------------------- item 18


def test_item18_device_context_honoured_in_recompute():
    devices = []

    def fn(x):
        devices.append(torch.empty(1).device.type)  # factory: follows torch.device(...)
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with torch.device("meta"):
        out = gradckpt.checkpoint(fn, x)
    out.sum().backward()  # outside the device context
    assert devices == ["meta", "meta"]
    assert torch.equal(x.grad, x.detach().cos())


# ---------------------------------------------------------------- item 19


def test_item19_meta_tensors_infer_meta_and_run():
    x = torch.randn(3, 4, device="meta", requires_grad=True)
    out = gradckpt.checkpoint(lambda t: t.sin().cos(), x)
    out.sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape
    assert engine_state.infer_device_type([torch.randn(1), x]) == "meta"
    assert engine_state.infer_device_type([torch.randn(1)]) == "cuda"  # torch's default


def _fake(kind):
    return types.SimpleNamespace(device=torch.device(kind))


def test_item19_mixed_device_types_warn_naming_them():
    with pytest.warns(UserWarning, match=r"several device types \['meta', 'cuda'\]"):
        kind = engine_state.infer_device_type([_fake("cpu"), _fake("meta"), _fake("cuda:1")])
    assert kind == "meta"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine_state.infer_device_type([_fake("cpu"), _fake("meta")]) == "meta"


def test_item19_mixed_device_types_warn_from_checkpoint(monkeypatch):
    real = engine_state.infer_device_type
    # CPU-only build: pretend one input lives on a second device type.
    monkeypatch.setattr(
        engine_state,
        "infer_device_type",
        lambda tensors: real([*tensors, _fake("cuda")]),
    )
    x = torch.randn(2, requires_grad=True)
    m = torch.randn(2, device="meta")
    with pytest.warns(UserWarning, match="several device types"):
        gradckpt.checkpoint(lambda a, b: a.sin(), x, m).sum().backward()


# ---------------------------------------------------------------- item 20


def _fake_lazy_init(monkeypatch):
    flag = {"initialized": False}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: flag["initialized"])

    def fn(x):
        flag["initialized"] = True  # stands for a first CUDA call inside the region
        return x.sin()

    return flag, fn


def test_item20_device_initialized_inside_forward_raises(monkeypatch):
    _, fn = _fake_lazy_init(monkeypatch)
    with pytest.raises(RuntimeError, match="initialized inside a checkpointed region"):
        gradckpt.checkpoint(fn, torch.randn(2, requires_grad=True))


def test_item20_no_error_without_rng_preservation_or_when_already_initialized(monkeypatch):
    flag, fn = _fake_lazy_init(monkeypatch)
    x = torch.randn(2, requires_grad=True)
    gradckpt.checkpoint(fn, x, preserve_rng_state=False).sum().backward()
    assert flag["initialized"]
    gradckpt.checkpoint(fn, x).sum().backward()  # initialized before the region: fine
