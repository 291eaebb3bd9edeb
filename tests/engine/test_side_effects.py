"""Checklist items 26, 36, 38: memory, module side effects, torch.compile (frameworks.md §3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt
from gradckpt import policies
from gradckpt.measure import MemoryTracker

# ---------------------------------------------------------------- item 36


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8)
    )


def _bn_step(call, *, momentum=0.1, backwards=1):
    model = _bn_model()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.momentum = momentum
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = call(model, x)
    for i in range(backwards):
        out.sum().backward(retain_graph=i < backwards - 1)
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # running stats, counts
    return buffers, [x.grad] + [p.grad for p in model.parameters()]


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: gradckpt.checkpoint(m, x),
        lambda m, x: gradckpt.checkpoint(m, x, policy=policies.save_matmuls),
        lambda m, x: gradckpt.checkpoint_sequential(m, 2, x),
        lambda m, x: gradckpt.checkpoint(lambda h: gradckpt.checkpoint(m, h), x),
    ],
    ids=["plain-region", "save_matmuls", "sequential", "nested"],
)
def test_item36_batchnorm_running_stats_updated_once(call):
    plain_state, plain_grads = _bn_step(lambda m, x: m(x))
    state, grads = _bn_step(call)
    _assert_same_state(state, plain_state)
    assert state["1.num_batches_tracked"].item() == 1
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_item36_cumulative_average_and_second_backward_update_once():
    """momentum=None uses num_batches_tracked in the update; retain_graph reruns too."""
    plain_state, plain_grads = _bn_step(lambda m, x: m(x), momentum=None, backwards=2)
    state, grads = _bn_step(lambda m, x: gradckpt.checkpoint(m, x), momentum=None, backwards=2)
    _assert_same_state(state, plain_state)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_item36_torch_updates_batchnorm_twice_we_do_not():
    """Documents the improvement over pytorch#96136."""
    state, _ = _bn_step(lambda m, x: torch_checkpoint(m, x, use_reentrant=False))
    plain_state, _ = _bn_step(lambda m, x: m(x))
    assert state["1.num_batches_tracked"].item() == 2
    assert not torch.equal(state["1.running_mean"], plain_state["1.running_mean"])


class StepCounter(nn.Module):
    """A module that counts its calls in a buffer (any in-place write to state)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.calls.add_(1)
        return torch.tanh(self.lin(x))


def test_item36_any_buffer_write_happens_once_per_step():
    m = StepCounter()
    x = torch.randn(2, 4, requires_grad=True)
    gradckpt.checkpoint(m, x).sum().backward()
    assert m.calls.item() == 1
    torch_checkpoint(m, x, use_reentrant=False).sum().backward()
    assert m.calls.item() == 3  # torch: forward + recompute


# ---------------------------------------------------------------- item 26


def test_item26_peak_memory_lower_than_plain():
    layers, batch, width = 8, 512, 16  # activations dominate the parameters
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )
    x = torch.randn(batch, width, requires_grad=True)

    def plain_step():
        model(x).sum().backward()

    def ckpt_step():
        h = x
        for block in model:
            h = gradckpt.checkpoint(block, h)
        h.sum().backward()

    plain = MemoryTracker.measure(model, plain_step)
    model.zero_grad(set_to_none=True)
    x.grad = None
    ckpt = MemoryTracker.measure(model, ckpt_step)
    # Plain keeps two activations per layer (Linear's input, GELU's input): 2L at the
    # start of backward. Per-layer checkpointing keeps each block's input (L) and,
    # while one block is recomputed, GELU's input and output (2 more): 2L - (L + 2).
    activation = batch * width * 4
    assert plain.peak_bytes - ckpt.peak_bytes >= (layers - 2) * activation


# ---------------------------------------------------------------- item 38


def test_item38_works_under_torch_compile_aot_eager():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def region(t):
        return torch.nn.functional.dropout(lin(t).relu().sin(), 0.5)

    torch.manual_seed(1)
    region(x).sum().backward()
    plain = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = None
    lin.zero_grad(set_to_none=True)

    # The region is a graph break (gradckpt.engine.dynamo): it runs eagerly in its
    # forward and its recompute alike, so both save eager's tensors; the code
    # around it compiles. (Before, Dynamo traced into the region and its compiled
    # forward saved the partitioner's tensors: CheckpointError on a shape mismatch.)
    compiled = torch.compile(lambda t: gradckpt.checkpoint(region, t), backend="aot_eager")
    torch.manual_seed(1)
    try:
        compiled(x).sum().backward()
    finally:
        torch._dynamo.reset()
    assert torch.equal(x.grad, plain[0]) and torch.equal(lin.weight.grad, plain[1])
