"""MemoryTracker: peak and breakdown computed by hand, nesting, fake/meta, bookkeeping."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from gradckpt.measure import MemoryTracker, state_bytes

F32 = 4
B, IN, OUT = 16, 8, 4


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(IN, OUT)


def test_known_allocations_without_model():
    before = torch.empty(1000)  # not created in the region: never counted
    with MemoryTracker() as mt:
        a = torch.empty(256)  # 1024
        b = a.view(16, 16).t()  # view: 0
        b.add_(1)  # in-place: 0
        c = torch.empty(100, dtype=torch.float64)  # 800 -> peak 1824
        before.mul_(2)
        del a, b  # -1024
        d = torch.empty(10)  # 40
        assert mt.live_created_bytes == 840
    assert (mt.peak_created_bytes, mt.param_bytes, mt.peak_bytes) == (1824, 0, 1824)
    assert mt.end_bytes == 840
    assert mt.breakdown == {"params": 0, "grads": 0, "activations": 1824}
    assert mt.timeline == [(0, 1024), (1, 1824), (2, 800), (3, 840)]
    assert mt.num_events == 4
    del c, d


def test_linear_forward_backward_by_hand():
    lin = _linear()
    x = torch.randn(B, IN)  # no grad: backward computes no grad_input
    with MemoryTracker(lin) as mt:
        y = lin(x)
        loss = y.sum()
        loss.backward()
    y_bytes, scalar = B * OUT * F32, F32
    w_grad, b_grad = OUT * IN * F32, OUT * F32
    # Everything is alive at the end of backward, the backward seed (ones_like) included.
    assert mt.peak_created_bytes == y_bytes + scalar + scalar + w_grad + b_grad == 408
    assert mt.param_bytes == w_grad + b_grad == 144
    assert mt.peak_bytes == 144 + 408
    assert mt.breakdown == {"params": 144, "grads": 144, "activations": 264}
    assert mt.end_bytes == 408 - scalar  # the seed is gone
    assert mt.device_peak_bytes is None  # CPU: no device counter is ever read
    del y, loss


def test_linear_with_input_grad_by_hand():
    lin = _linear()
    x = torch.randn(B, IN, requires_grad=True)
    with MemoryTracker(lin) as mt:
        lin(x).sum().backward()  # y is dropped after sum: SumBackward does not keep it
    x_grad = B * IN * F32
    grads = OUT * IN * F32 + OUT * F32
    # Forward peak: y (256) + loss (4) = 260. Backward peak: loss + seed + all grads.
    assert mt.peak_created_bytes == F32 + F32 + x_grad + grads == 664
    assert mt.breakdown == {"params": 144, "grads": 144, "activations": 520}
    assert mt.end_bytes == x_grad + grads
    assert max(live for _, live in mt.timeline) == 664
    assert mt.timeline[1] == (1, 260)


def test_grads_that_existed_before_are_not_created():
    lin = _linear()
    x = torch.randn(B, IN)
    lin(x).sum().backward()  # grads exist now; the next backward accumulates in place
    with MemoryTracker(lin) as mt:
        y = lin(x)
        y.sum().backward()
    # y, loss, seed, and the fresh grads that are added into the old .grad then freed
    assert mt.peak_created_bytes == B * OUT * F32 + F32 + F32 + OUT * IN * F32 + OUT * F32
    assert mt.breakdown == {"params": 144, "grads": 0, "activations": 408}
    assert mt.end_bytes == B * OUT * F32  # the loss is a temporary here; y is kept
    del y


def test_param_bytes_count_params_and_buffers_once_by_storage():
    shared = nn.Linear(4, 4)  # 16 + 4 floats
    model = nn.Sequential(shared, nn.BatchNorm1d(4), shared)
    # BatchNorm1d(4): weight, bias, running_mean, running_var (4 floats each), num_batches (int64)
    expected = (16 + 4) * F32 + 4 * 4 * F32 + 8
    assert state_bytes(model) == expected
    tied = nn.Linear(4, 4, bias=False)
    other = nn.Linear(4, 4, bias=False)
    other.weight = tied.weight
    assert state_bytes(nn.ModuleList([tied, other])) == 16 * F32
    with MemoryTracker(model) as mt:
        pass
    assert mt.param_bytes == mt.peak_bytes == mt.breakdown["params"] == expected
    assert mt.num_events == 0


class _Doubler(TorchDispatchMode):
    """Another mode that allocates a copy of every mm output (to be seen by outer modes)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default:
            out.clone()
        return out


def test_nests_with_inner_modes_and_other_trackers():
    a, b = torch.ones(8, 8), torch.ones(8, 8)
    with MemoryTracker() as outer:
        with _Doubler():
            c = a @ b  # 256 bytes plus a temporary clone of 256 bytes
        with MemoryTracker() as inner:
            d = a @ b
    # c, the inner mode's clone of it (dropped at once), then d
    assert outer.timeline == [(0, 256), (1, 512), (2, 256), (3, 512)]
    assert outer.peak_created_bytes == 512
    assert inner.peak_created_bytes == inner.end_bytes == 256
    assert outer.end_bytes == 512
    assert _get_current_dispatch_mode_stack() == []
    del c, d


def test_exception_inside_the_region_still_finishes():
    with pytest.raises(ValueError), MemoryTracker() as mt:
        keep = torch.empty(25)
        raise ValueError("boom")
    assert _get_current_dispatch_mode_stack() == []
    assert mt.peak_created_bytes == mt.end_bytes == 100
    del keep


def test_reentering_resets_and_frees_after_exit_are_ignored():
    mt = MemoryTracker()
    with mt:
        keep = torch.empty(100)
    assert mt.end_bytes == 400
    del keep  # after exit: not recorded
    assert mt.num_events == 1
    with mt:
        torch.empty(10)
    assert (mt.peak_created_bytes, mt.end_bytes, mt.num_events) == (40, 0, 2)


def test_measure_classmethod_and_text():
    lin = _linear()
    x = torch.randn(B, IN)
    mt = MemoryTracker.measure(lin, lambda: lin(x).sum().backward())
    # The forward is the peak here: y (dropped before backward) and the loss.
    assert mt.peak_bytes == 144 + B * OUT * F32 + F32
    assert mt.breakdown == {"params": 144, "grads": 0, "activations": 260}
    assert mt.end_bytes == OUT * IN * F32 + OUT * F32
    assert "MiB" in repr(mt) and "MiB" in mt.summary()
    assert mt.summary().splitlines()[0].startswith("peak")


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)
    )


def _step(model: nn.Module, x: torch.Tensor) -> MemoryTracker:
    with MemoryTracker(model) as mt:
        model(x).logsumexp(-1).mean().backward()
    return mt


def test_fake_and_meta_runs_give_the_real_peak():
    torch.manual_seed(0)
    real = _step(_mlp(), torch.randn(128, 32))
    with FakeTensorMode():
        fake = _step(_mlp(), torch.randn(128, 32))
    meta = _step(_mlp().to("meta"), torch.randn(128, 32, device="meta"))
    assert real.peak_created_bytes > 128 * 64 * F32
    for other in (fake, meta):
        assert other.peak_bytes == real.peak_bytes
        assert other.breakdown == real.breakdown
        assert other.end_bytes == real.end_bytes
        assert other.timeline == real.timeline
        assert other.device_peak_bytes is None
