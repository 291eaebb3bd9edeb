"""The tracker sees checkpointing: recompute in backward, engine dispatch modes inside it."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_ckpt

import gradckpt
from gradckpt.measure import MemoryTracker, count_flops, count_ops

WRAPS = {
    "plain": lambda block, x: block(x),
    "torch": lambda block, x: torch_ckpt.checkpoint(block, x, use_reentrant=False),
    "gradckpt": lambda block, x: gradckpt.checkpoint(block, x),
}


@pytest.fixture(scope="module")
def peaks(residual_mlp):
    model = residual_mlp(n=6, d=256, h=1024)
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, wrap in WRAPS.items():
        model.wrap = wrap
        model.zero_grad(set_to_none=True)
        with MemoryTracker(model) as mt:
            model(x).sum().backward()
        out[name] = mt
    return out


def test_checkpointing_lowers_the_peak(peaks):
    plain, torch_, ours = (peaks[k].peak_bytes for k in ("plain", "torch", "gradckpt"))
    print(f"peak bytes: plain {plain}, torch {torch_}, gradckpt {ours}")
    assert ours <= 1.05 * torch_
    assert ours < 0.8 * plain


def test_breakdown_parts_are_consistent(peaks):
    params = sum(p.numel() * 4 for p in peaks["plain"].model.parameters())
    for mt in peaks.values():
        b = mt.breakdown
        assert b["params"] == mt.param_bytes == params
        assert b["params"] + b["grads"] + b["activations"] == mt.peak_bytes
        assert mt.end_bytes == params  # exactly the grads survive the step
    # With checkpointing the peak moves to late backward, where most grads exist.
    assert peaks["gradckpt"].breakdown["grads"] > peaks["plain"].breakdown["grads"]
    assert peaks["gradckpt"].breakdown["activations"] < peaks["plain"].breakdown["activations"]


def test_flops_and_ops_show_the_recompute(residual_mlp):
    model = residual_mlp(n=2, d=16, h=32)
    x = torch.randn(8, 16)
    fc1_forward = 2 * 8 * 16 * 32  # early stop: only fc1 is recomputed (GELU needs its output)
    results = {}
    for name, wrap in WRAPS.items():
        model.wrap = wrap
        model.zero_grad(set_to_none=True)
        flops = count_flops(lambda: model(x).sum().backward())
        model.zero_grad(set_to_none=True)
        ops = count_ops(lambda: model(x).sum().backward())
        results[name] = (flops, ops)
    plain_flops, plain_ops = results["plain"]
    for name in ("torch", "gradckpt"):
        flops, ops = results[name]
        assert flops.total == plain_flops.total + 2 * fc1_forward, name
        assert ops["aten.addmm.default"] == plain_ops["aten.addmm.default"] + 2, name
        assert ops["aten.mm.default"] == plain_ops["aten.mm.default"], name
