"""Allocator-level peaks: checked against an independent malloc-level count.

The counter is a tiny C library preloaded into a child interpreter
(``tests/measure/conftest.py``): it wraps glibc's malloc family and keeps the
live and peak bytes (by ``malloc_usable_size``). torch's CPU allocator gets its memory from
``posix_memalign``, so every tensor, kernel workspace and oneDNN scratchpad
passes through it; so do the interpreter's and autograd's own small objects,
which is why the two are compared within 1%, not exactly.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from gradckpt.measure import AllocatorTracker, MemoryEvents, MemoryTracker
from gradckpt.measure.allocator import close_mark, open_mark

# Runs in the child: per model one warm step, then the same step under the malloc
# counter and under AllocatorTracker (never both at once: the profiler mallocs too).
CHILD = textwrap.dedent(
    """
    import ctypes, gc, json, sys
    from gradckpt import testing
    from gradckpt.measure import AllocatorTracker, MemoryTracker
    lib = ctypes.CDLL(None)
    lib.gck_peak.restype = lib.gck_current.restype = ctypes.c_longlong
    results = {}
    for name, sizes in json.loads(sys.argv[1]):
        ex = testing.make(name, **sizes)
        def clear():
            for p in ex.model.parameters():
                p.grad = None
            gc.collect()
        ex.loss_fn().backward()
        clear()
        base = lib.gck_current()
        lib.gck_reset_peak()
        ex.loss_fn().backward()
        malloc_peak = lib.gck_peak() - base
        clear()
        with AllocatorTracker() as at:
            ex.loss_fn().backward()
        clear()
        with MemoryTracker() as mt:
            ex.loss_fn().backward()
        results[name] = [malloc_peak, at.peak_bytes, mt.peak_bytes]
    print(json.dumps(results))
    """
)

MODELS = [
    ("unet", {"depth": 3, "base": 32, "image": 128, "batch": 4}),  # convs: hidden workspaces
    ("gpt", {"batch": 8}),  # attention
    ("mlp", {"width": 1024, "batch": 256}),
]


def test_allocator_peak_matches_malloc_count(run_counted) -> None:
    results = run_counted(CHILD, MODELS)
    assert sorted(results) == sorted(name for name, _ in MODELS)
    for name, (malloc_peak, allocator_peak, tracker_peak) in results.items():
        assert malloc_peak > 1 << 20, name  # the counter did see the step
        assert abs(allocator_peak - malloc_peak) <= 0.01 * malloc_peak, (name, results[name])
        assert allocator_peak >= tracker_peak, name  # it sees every tensor and more
    _, unet_allocator, unet_tracker = results["unet"]
    assert unet_allocator > 1.05 * unet_tracker  # convolution workspaces are real memory


def test_allocator_sees_workspace_the_tracker_cannot() -> None:
    # Convolution backward allocates its im2col columns inside the kernel.
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(2, 8, 32, 32, requires_grad=True)
    with AllocatorTracker() as at:
        conv(x).sum().backward()
    conv.zero_grad(set_to_none=True)
    x.grad = None
    with MemoryTracker() as mt:
        conv(x).sum().backward()
    assert at.peak_bytes >= mt.peak_bytes > 0
    assert at.method == "profiler-events" and at.reserved_peak_bytes is None


def test_peak_is_relative_to_entry_and_counts_only_new_memory() -> None:
    held = torch.empty(1 << 20)  # allocated before: not part of the region
    with AllocatorTracker() as at:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(2000)  # 8000 B
        del a
        del held  # freeing older memory does not lower the region's peak
    assert at.peak_bytes == 12_000
    assert at.end_bytes == 8_000
    del b


def test_marked_spans_give_each_ops_transient() -> None:
    x = torch.randn(1000)
    with MemoryEvents() as ev:
        h = open_mark(3)
        y = x.exp()  # one 4000 B output, nothing transient
        close_mark(h)
        h = open_mark(4)
        t = torch.empty(5000)  # a 20000 B temporary freed before the span ends
        z = y + y
        del t
        close_mark(h)
    spans = ev.spans()
    assert spans[3].peak - spans[3].before == 4000
    assert spans[4].peak - spans[4].before == 24_000
    assert spans[4].after - spans[4].before == 4000
    del z


def test_cannot_run_inside_another_profiler() -> None:
    with (
        torch.profiler.profile(),
        pytest.raises(RuntimeError, match="another profiler"),
        AllocatorTracker(),
    ):
        pass


def test_unsupported_device_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu and cuda"):
        AllocatorTracker("meta")


def test_profiler_noise_is_dropped_and_other_stderr_kept(capfd) -> None:

    with AllocatorTracker():
        torch.empty(10)
        print("a line of the user's own", file=sys.stderr, flush=True)
    err = capfd.readouterr().err
    assert "a line of the user's own" in err
    assert "USDT" not in err and "profiler_start" not in err


def test_loose_blocks_between_spans_are_charged_to_the_next_span() -> None:
    x = torch.randn(1000)
    with MemoryEvents() as ev:
        scalar = torch.empty(16)  # 64 B made outside every span, still held by the op
        h = open_mark(0)
        y = x.exp()  # its 4000 B output
        close_mark(h)
        del scalar
        gone = torch.empty(32)  # made and freed between spans: charged to nobody
        del gone
        h = open_mark(1)
        z = y.exp()
        close_mark(h)
    spans = ev.spans()
    assert spans[0].loose == 64 and spans[1].loose == 0
    del z


def test_sessions_nest_and_an_inner_one_counts_for_the_outer() -> None:
    with AllocatorTracker() as outer:
        a = torch.empty(1000)  # 4000 B
        with AllocatorTracker() as inner:
            b = torch.empty(2000)  # 8000 B
            del b
        c = torch.empty(500)  # 2000 B
    assert inner.peak_bytes == 8_000 and inner.end_bytes == 0
    assert outer.peak_bytes == 12_000 and outer.end_bytes == 6_000
    del a, c


def test_a_session_closing_before_one_opened_inside_it_keeps_its_own_events() -> None:
    """A tracker around a step that closes while a tracker opened in the step is still
    open (a callback's measurement left open across steps): each sees what happened
    while it was open, and nothing of the other's time outside it."""
    outer = AllocatorTracker().__enter__()
    a = torch.empty(1000)  # 4000 B, outer only
    inner = AllocatorTracker().__enter__()
    b = torch.empty(2000)  # 8000 B, both
    outer.__exit__(None, None, None)
    c = torch.empty(4000)  # 16000 B, inner only
    del b
    inner.__exit__(None, None, None)
    assert outer.peak_bytes == 12_000 and outer.end_bytes == 12_000
    assert inner.peak_bytes == 24_000 and inner.end_bytes == 16_000
    with AllocatorTracker() as after:  # the profiler is free again and stderr restored
        d = torch.empty(250)
    assert after.peak_bytes == 1_000
    del a, c, d
