"""Checklist items 30, 31, 34: determinism check, debug traces, context_fn (frameworks.md §3)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt


def _changes_on_recompute(first, later):
    """A function that runs ``first`` on its first call and ``later`` afterwards."""
    calls = []

    def fn(x):
        calls.append(1)
        return first(x) if len(calls) == 1 else later(x)

    return fn


# ---------------------------------------------------------------- item 30


def test_item30_fewer_saved_tensors_in_recompute_raises():
    fn = _changes_on_recompute(lambda x: x.sin().sin(), lambda x: x.sin())
    x = torch.randn(3, requires_grad=True)
    out = gradckpt.checkpoint(fn, x)
    with pytest.raises(gradckpt.CheckpointError, match=r"saved 1 tensors.*but 2.*debug=True"):
        out.sum().backward()


def test_item30_more_saved_tensors_in_recompute_raises_without_early_stop():
    fn = _changes_on_recompute(lambda x: x.sin() * 2, lambda x: x.sin().sin())
    x = torch.randn(3, requires_grad=True)
    out = gradckpt.checkpoint(fn, x, early_stop=False)
    with pytest.raises(gradckpt.CheckpointError, match=r"more tensors.*debug=True"):
        out.sum().backward()


def _scaled(size, dtype=torch.float32):
    return lambda x: x * torch.full((size,), 2.0, dtype=dtype)  # mul saves the scale


def test_item30_different_shape_in_recompute_raises():
    x = torch.randn(4, requires_grad=True)
    out = gradckpt.checkpoint(_changes_on_recompute(_scaled(4), _scaled(1)), x)
    with pytest.raises(gradckpt.CheckpointError, match=r"torch.Size\(\[1\]\).*debug=True"):
        out.sum().backward()


def test_item30_different_dtype_in_recompute_raises():
    x = torch.randn(4, requires_grad=True)
    out = gradckpt.checkpoint(
        _changes_on_recompute(lambda x: x.sin(), lambda x: x.double().sin().float()), x
    )
    with pytest.raises(gradckpt.CheckpointError, match=r"torch.float64.*debug=True"):
        out.sum().backward()


def test_item30_torch_raises_on_the_same_mismatch():
    """Reference: torch's non-reentrant checkpoint catches the same shape change."""
    x = torch.randn(4, requires_grad=True)
    fn = _changes_on_recompute(_scaled(4), _scaled(1))
    out = torch_checkpoint(fn, x, use_reentrant=False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        out.sum().backward()


def test_item30_determinism_check_none_skips_the_shape_check():
    # The recomputed scale has shape [1] instead of [4]; it broadcasts to the
    # same gradient, so without the check backward succeeds with eager grads.
    x = torch.randn(4, requires_grad=True)
    out = gradckpt.checkpoint(
        _changes_on_recompute(_scaled(4), _scaled(1)), x, determinism_check="none"
    )
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))


@pytest.mark.parametrize("value", ["strict", None, True, "DEFAULT"])
def test_item30_unknown_determinism_check_raises_value_error(value):
    with pytest.raises(ValueError, match="determinism_check"):
        gradckpt.checkpoint(torch.sin, torch.randn(2), determinism_check=value)


# ---------------------------------------------------------------- item 31


def test_item31_debug_error_lists_both_op_sequences():
    fn = _changes_on_recompute(lambda x: x.sin().sin(), lambda x: x.cos())
    x = torch.randn(3, requires_grad=True)
    out = gradckpt.checkpoint(fn, x, debug=True)
    with pytest.raises(gradckpt.CheckpointError) as info:
        out.sum().backward()
    message = str(info.value)
    assert "Ops in the forward:\n  aten.sin.default\n  aten.sin.default\n" in message
    assert message.endswith("Ops in the recompute:\n  aten.cos.default")


def test_item31_without_debug_no_op_sequences():
    fn = _changes_on_recompute(lambda x: x.sin().sin(), lambda x: x.cos())
    out = gradckpt.checkpoint(fn, torch.randn(3, requires_grad=True))
    with pytest.raises(gradckpt.CheckpointError) as info:
        out.sum().backward()
    assert "Ops in the forward" not in str(info.value)


def test_item31_debug_combines_with_context_fn():
    """torch raises ValueError for debug=True with a context_fn; we allow both."""
    events = []
    fn = _changes_on_recompute(lambda x: x.sin().sin(), lambda x: x.cos())
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="context_fn"):
        torch_checkpoint(fn, x, use_reentrant=False, debug=True, context_fn=_contexts(events))
    out = gradckpt.checkpoint(fn, x, debug=True, context_fn=_contexts(events))
    with pytest.raises(gradckpt.CheckpointError, match="Ops in the recompute"):
        out.sum().backward()
    assert events == ["forward+", "forward-", "recompute+", "recompute-"]


# ---------------------------------------------------------------- item 34


class _Phase:
    """A re-enterable context manager that logs enter/exit and marks the phase."""

    current: str | None = None

    def __init__(self, name, events):
        self.name, self.events = name, events

    def __enter__(self):
        self.events.append(f"{self.name}+")
        self.outer, _Phase.current = _Phase.current, self.name

    def __exit__(self, *exc):
        self.events.append(f"{self.name}-")
        _Phase.current = self.outer


def _contexts(events):
    return lambda: (_Phase("forward", events), _Phase("recompute", events))


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_item34_context_fn_runs_forward_and_recompute_contexts(impl):
    events, phases = [], []

    def fn(x):
        phases.append(_Phase.current)
        return x.sin().exp()

    x = torch.randn(3, requires_grad=True)
    if impl == "ours":
        out = gradckpt.checkpoint(fn, x, context_fn=_contexts(events))
    else:
        out = torch_checkpoint(fn, x, use_reentrant=False, context_fn=_contexts(events))
    assert phases == ["forward"] and events == ["forward+", "forward-"]
    out.sum().backward(retain_graph=True)
    assert phases == ["forward", "recompute"]
    assert events == ["forward+", "forward-", "recompute+", "recompute-"]
    out.sum().backward()  # a second backward recomputes under the same context again
    assert phases == ["forward", "recompute", "recompute"]
    assert torch.allclose(x.grad, 2 * x.detach().cos() * x.detach().sin().exp())


def test_item34_context_fn_must_return_two_contexts():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises((TypeError, ValueError)):
        gradckpt.checkpoint(torch.sin, x, context_fn=lambda: None)
