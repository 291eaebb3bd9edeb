"""Double backward through nested checkpoints terminates with plain autograd's gradients.

A checkpointed function that runs ``torch.autograd.grad`` through an inner
checkpointed region, differentiated again: inside the outer region's
recompute, that ``autograd.grad`` (a new backward pass) reaches tensors the
inner region deferred; they must come from the inner region's recompute, not
from recomputing the outer region again (which reruns the same
``autograd.grad``, without end: a RecursionError the autograd engine surfaced
as ``SystemError``). Gradient penalties, higher-order gradients and
meta-learning over checkpointed models meet this.

Compositions are written inside out: ``"gc"`` is ``c(grad(f))``, checkpoint
of the gradient of f; ``"cgc"`` is ``c(grad(c(f)))``.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable

import pytest
import torch

import gradckpt
from gradckpt import policies
from gradckpt.engine import recompute as recompute_module

Fn = Callable[[torch.Tensor], torch.Tensor]


def f(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * x.exp()).cos()


def _checkpointed(inner: Fn, checkpoint: Callable[..., torch.Tensor]) -> Fn:
    return lambda x: checkpoint(inner, x)


def _gradient(inner: Fn) -> Fn:
    return lambda x: torch.autograd.grad(inner(x).sum(), x, create_graph=True)[0]


def compose(ops: str, checkpoint: Callable[..., torch.Tensor] | None) -> Fn:
    """Apply ``ops`` to ``f`` left to right: ``c`` checkpoints, ``g`` takes the gradient."""
    h: Fn = f
    for op in ops:
        if op == "g":
            h = _gradient(h)
        elif checkpoint is not None:
            h = _checkpointed(h, checkpoint)
    return h


def final_grad(h: Fn, x: torch.Tensor, outer_grads: int) -> torch.Tensor:
    y = h(x)
    for _ in range(outer_grads):
        y = torch.autograd.grad(y.sum(), x, create_graph=True)[0]
    return torch.autograd.grad(y.sum(), x)[0]


def nestings(depth: int) -> list[str]:
    """Compositions with ``depth`` checkpoints and at least one gradient inside them."""
    found = []
    for n in range(depth + 1, depth + 3):
        for ops in itertools.product("cg", repeat=n):
            word = "".join(ops)
            if word.count("c") == depth and "g" in word.rstrip("g"):
                found.append(word)
    return found


DEPTH_2 = nestings(2)
DEPTH_3 = nestings(3)


def test_the_issue_cases_are_covered():
    assert "cgc" in DEPTH_2 and "cggc" in DEPTH_2  # c(grad(c(f))), c(grad(grad(c(f))))
    assert "cgcgc" in DEPTH_3 and "gccc" in DEPTH_3
    assert len(DEPTH_2) == 7 and len(DEPTH_3) == 12


@pytest.mark.parametrize("outer_grads", [0, 1], ids=["grad", "grad-grad"])
@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full"])
@pytest.mark.parametrize("ops", DEPTH_2 + DEPTH_3)
def test_nested_double_backward_matches_plain_autograd(ops, early_stop, outer_grads):
    x = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)

    def checkpoint(fn, t):
        return gradckpt.checkpoint(fn, t, early_stop=early_stop)

    got = final_grad(compose(ops, checkpoint), x, outer_grads)
    expected = final_grad(compose(ops, None), x, outer_grads)
    assert torch.equal(got, expected)


def test_nested_double_backward_with_a_policy_and_parameters():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def inner(t):
        return torch.tanh(lin(t)).exp()

    def penalty(t, ckpt):
        y = ckpt(inner, t)
        (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)
        return y * g.square()

    def ours(fn, *a):
        return gradckpt.checkpoint(fn, *a, policy=policies.save_matmuls)

    got = torch.autograd.grad(ours(penalty, x, ours).sum(), [x, *lin.parameters()])
    ref = torch.autograd.grad(penalty(x, lambda fn, t: fn(t)).sum(), [x, *lin.parameters()])
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_runaway_recompute_is_a_checkpoint_error_not_a_system_error(monkeypatch):
    # With the depth cap at 1, c(c(grad(f))) needs two recomputes inside one
    # another: the cap must speak as a CheckpointError (torch's type), never
    # as the RecursionError/SystemError an unbounded recursion ends in.
    monkeypatch.setattr(recompute_module, "MAX_RECOMPUTE_DEPTH", 1)
    x = torch.randn(3, requires_grad=True)
    out = compose("gcc", gradckpt.checkpoint)(x)
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="inside one another"):
        out.sum().backward()


def test_a_real_runaway_ends_in_checkpoint_error_at_the_default_cap(monkeypatch):
    # Undo the fix (and the guard against a region recomputing inside its own
    # recompute) to get back the unbounded recursion of the issue: at the
    # default cap it must still end as a CheckpointError, before Python's or the
    # autograd engine's own limits turn it into a SystemError.
    from gradckpt.engine import holders

    monkeypatch.setattr(holders, "_deferred_by_running_recompute", lambda holder, gid: None)
    monkeypatch.setattr(recompute_module, "running_gid", lambda frame: None)
    x = torch.randn(3, requires_grad=True)
    out = compose("cgc", gradckpt.checkpoint)(x)
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="at most 32"):
        torch.autograd.grad(out.sum(), x)


@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "GraphExecGroup"), reason="no GraphExecGroup"
)
@pytest.mark.parametrize("ops", DEPTH_2 + DEPTH_3)
def test_nested_double_backward_inside_a_graph_exec_group(ops):
    # The autograd.grad calls inside the checkpointed code are passes of their
    # own, not part of the caller's group (torch's checkpoint refuses 7 of these).
    x = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)
    out = compose(ops, gradckpt.checkpoint)(x)
    with torch.utils.checkpoint.GraphExecGroup():
        (got,) = torch.autograd.grad(out.sum(), x)
    (expected,) = torch.autograd.grad(compose(ops, None)(x).sum(), x)
    assert torch.equal(got, expected)


def test_a_recursion_error_in_the_recompute_is_a_checkpoint_error_with_its_cause():
    calls = []

    def deep(n: int, x: torch.Tensor) -> torch.Tensor:
        return x if n == 0 else deep(n - 1, x)

    def fn(x):
        calls.append(1)
        if len(calls) > 1:
            deep(sys.getrecursionlimit() + 10, x)  # only the recompute recurses too deep
        return x.sin()

    out = gradckpt.checkpoint(fn, torch.randn(3, requires_grad=True))
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="recursion limit") as info:
        out.sum().backward()
    assert isinstance(info.value.__cause__, RecursionError)
