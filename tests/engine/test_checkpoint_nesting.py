"""Checklist item 27: nested checkpoints, with and without policies (frameworks.md §3).

The engine's rule (frame.py): a region opened during an enclosing region's
*forward* is a no-op; one opened during the enclosing region's *recompute* is a
real region, recomputed again later when backward needs its tensors. So in a
chain of k nested regions, level i runs i + 1 times per forward+backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt
from gradckpt import policies
from gradckpt.measure import count_ops


class Nest(nn.Module):
    """Four Linear+Tanh(+Dropout) layers; ``levels`` regions nested around layers 2-3."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lins = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.drop = nn.Dropout(0.3)
        self.calls = [0, 0, 0]

    def layer(self, i, h):
        return self.drop(torch.tanh(self.lins[i](h)))

    def f3(self, c):
        self.calls[2] += 1
        return self.layer(2, c)

    def f2(self, a, ckpt, p3):
        self.calls[1] += 1
        c = self.layer(1, a)
        return ckpt(self.f3, c, policy=p3) if p3 != "plain" else self.f3(c)

    def f1(self, x, ckpt, p2, p3):
        self.calls[0] += 1
        a = self.layer(0, x)
        b = ckpt(self.f2, a, ckpt, p3, policy=p2) if p2 != "plain" else self.f2(a, ckpt, p3)
        return self.layer(3, b)

    def forward(self, x, ckpt=None, p1=None, p2=None, p3=None):
        if ckpt is None:
            return self.f1(x, lambda f, *a, policy=None: f(*a), "plain", "plain")
        return ckpt(self.f1, x, ckpt, p2, p3, policy=p1)


def _ours(f, *args, policy=None):
    return gradckpt.checkpoint(f, *args, policy=policy)


def _torch(f, *args, policy=None):
    assert policy is None
    return torch_checkpoint(f, *args, use_reentrant=False)


def _run(model, ckpt, **policies_):
    """One seeded forward+backward; returns the output, grads and the ops that executed."""
    model.zero_grad(set_to_none=True)
    model.calls = [0, 0, 0]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(2)
    box = {}

    def step():
        box["out"] = model(x, ckpt, **policies_)
        box["out"].sum().backward()

    ops = count_ops(step)
    return box["out"].detach(), [x.grad] + [p.grad for p in model.parameters()], ops


def _assert_equal(a, b):
    assert torch.equal(a[0], b[0])
    for ga, gb in zip(a[1], b[1]):
        assert torch.equal(ga, gb)


def test_item27_two_levels_match_eager_and_run_counts():
    model = Nest()
    plain = _run(model, None)
    assert model.calls == [1, 1, 1]
    ours = _run(model, _ours, p3="plain")
    _assert_equal(ours, plain)
    # outer: forward + recompute; inner: no-op in forward, real in the outer's
    # recompute, then its own recompute.
    assert model.calls[:2] == [2, 3]


def test_item27_three_levels_match_eager_and_run_counts():
    model = Nest()
    plain = _run(model, None)
    ours = _run(model, _ours)
    _assert_equal(ours, plain)
    assert model.calls == [2, 3, 4]


def test_item27_nested_matches_torch_non_reentrant():
    model = Nest()
    _assert_equal(_run(model, _ours), _run(model, _torch))


# addmm executions over forward + backward for Nest (4 Linear layers, 1 addmm each).
# Plain: 4. Levels run 2/3/4 times, layer 0 and 3 belong to level 1 only, layer 1
# to levels 1-2, layer 2 to levels 1-3: 2 + 3 + 4 + 2 = 11 with no policy. A SAVE
# op is replayed, not executed, by every recompute that runs under the region
# whose policy saved it (the region's own recompute and regions opened inside it).
@pytest.mark.parametrize(
    ("p1", "p2", "p3", "addmm"),
    [
        (None, None, None, 11),
        # level 2 keeps layers 1 and 2 (level 3 is a no-op in level 2's forward):
        # layer 1 runs fwd + L1 recompute; layer 2 fwd + L1 recompute + L3 recompute.
        (None, policies.save_matmuls, None, 2 + 2 + 3 + 2),
        # level 1 keeps everything, so its recompute executes nothing; but levels
        # 2 and 3 become real regions in it and are recomputed later, outside it:
        # level 2's recompute runs layers 1-2, level 3's runs layer 2.
        (policies.save_all, None, None, 4 + 2 + 1),
        # level 3 keeps its matmul, so level 3's recompute replays it.
        (None, None, policies.save_matmuls, 2 + 3 + 3 + 2),
        (policies.save_matmuls, policies.save_all, policies.save_all, 4),
    ],
    ids=["none", "l2-matmuls", "l1-all", "l3-matmuls", "all-levels"],
)
def test_item27_nested_policies_match_eager_and_count_recomputed_matmuls(p1, p2, p3, addmm):
    model = Nest()
    plain = _run(model, None)
    assert plain[2]["aten.addmm.default"] == 4
    ours = _run(model, _ours, p1=p1, p2=p2, p3=p3)
    _assert_equal(ours, plain)
    assert ours[2]["aten.addmm.default"] == addmm


def test_item27_inner_region_is_noop_during_outer_forward():
    frames = []

    def inner(h):
        top = gradckpt.engine.active_frame()
        frames.append((top[0].name, top[1] is None))  # (region running, in its forward?)
        return h.sin()

    def outer(x):
        return gradckpt.checkpoint(inner, x.cos())

    x = torch.randn(3, requires_grad=True)
    out = gradckpt.checkpoint(outer, x)
    assert frames == [("outer", True)]  # the inner call opened no region of its own
    assert gradckpt.engine.active_frame() is None
    out.sum().backward()
    # outer's recompute opens inner for real, then inner's own recompute runs it
    assert frames == [("outer", True), ("inner", True), ("inner", False)]
    assert torch.allclose(x.grad, -x.detach().sin() * x.detach().cos().cos(), atol=1e-6)
