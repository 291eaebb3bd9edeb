"""The CUDA backend's ordering and pool logic, on CPU, through a fake stream API.

No GPU here: the fake records what the backend asks of streams and events, so
these tests check the order (wait for compute before a copy, compute waits for
the copy's event before a source is dropped, no record_stream) and the pinned
pool's reuse, not real overlap.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from gradckpt.engine.offload import OffloadSession, run_offloaded
from gradckpt.engine.offload.cuda import CudaOffloadBackend, PinnedPool, size_class
from gradckpt.engine.offload.store import HostOverBudgetError


class FakeStreams:
    """Stands for ``torch.cuda``: logs calls; events complete when ``done`` says so."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = self.Stream(name="compute")
        self.done = True

    def Stream(self, device=None, name="copy"):
        fake = self

        class _Stream:
            def __repr__(self) -> str:
                return name

            def wait_stream(self, other):
                fake.log.append(("wait_stream", name, repr(other)))

            def wait_event(self, event):
                fake.log.append(("wait_event", name, event.id))

        return _Stream()

    def Event(self):
        fake = self

        class _Event:
            id = sum(1 for e in fake.log if e[0] == "record")

            def record(self, stream):
                fake.log.append(("record", repr(stream), self.id))

            def query(self):
                return fake.done

        return _Event()

    def current_stream(self, device=None):
        return self.compute

    @contextlib.contextmanager
    def stream(self, s):
        self.log.append(("enter", repr(s)))
        yield
        self.log.append(("exit", repr(s)))


def _backend(**kw) -> tuple[CudaOffloadBackend, FakeStreams]:
    fake = FakeStreams()
    backend = CudaOffloadBackend(
        "cpu", streams=fake, allocate=lambda n: torch.empty(n, dtype=torch.uint8), **kw
    )
    return backend, fake


def test_size_class_rounds_up_to_a_power_of_two():
    assert size_class(1) == 4096
    assert size_class(4096) == 4096
    assert size_class(4097) == 8192
    assert size_class(3 << 20) == 4 << 20


def test_store_waits_for_compute_copies_on_the_copy_stream_then_records():
    backend, fake = _backend()
    flat = torch.arange(100, dtype=torch.uint8)
    ticket = backend.store(flat)
    assert fake.log == [
        ("wait_stream", "copy", "compute"),
        ("enter", "copy"),
        ("record", "copy", 0),
        ("exit", "copy"),
    ]
    assert torch.equal(ticket.buffer[:100], flat)
    backend.stored(ticket)  # the compute stream (not the host) waits for the copy
    assert fake.log[-1] == ("wait_event", "compute", 0)


def test_load_allocates_on_compute_fills_on_copy_and_compute_waits_before_use():
    backend, fake = _backend()
    flat = torch.arange(100, dtype=torch.uint8)
    ticket = backend.store(flat)
    fake.log.clear()
    pending = backend.load(ticket)
    out = backend.loaded(pending)
    assert torch.equal(out, flat)
    kinds = [e[0] for e in fake.log]
    assert kinds == ["wait_stream", "enter", "record", "exit", "wait_event"]
    assert fake.log[-1][1] == "compute"


def test_pool_reuses_a_buffer_only_after_its_last_copy_completed():
    backend, fake = _backend()
    t1 = backend.store(torch.zeros(5000, dtype=torch.uint8))
    backend.discard(t1)
    fake.done = False  # the copy that last touched t1's buffer is still running
    t2 = backend.store(torch.zeros(5000, dtype=torch.uint8))
    assert t2.buffer.data_ptr() != t1.buffer.data_ptr()
    assert backend.pool.made == 2
    backend.discard(t2)
    fake.done = True
    t3 = backend.store(torch.zeros(6000, dtype=torch.uint8))  # same size class (8 KiB)
    assert backend.pool.made == 2  # reused, no new pinned allocation
    assert t3.buffer.numel() == 8192


def test_pool_refuses_to_grow_past_the_host_budget():
    pool = PinnedPool(host_budget=8192, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    pool.take(8000)
    with pytest.raises(HostOverBudgetError, match="host budget of 8192"):
        pool.take(10)


def test_session_on_the_cuda_backend_gives_bit_equal_gradients_and_never_record_stream():
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32))
                           for _ in range(3))  # fmt: skip
    x = torch.randn(64, 32)

    def step(session):
        h = x
        for i, b in enumerate(blocks):
            h = run_offloaded(session, f"b{i}", b, (h,), {}, tuple(b.parameters())) if session \
                else b(h)  # fmt: skip
        h.sum().backward()
        grads = [p.grad.clone() for p in blocks.parameters()]
        blocks.zero_grad(set_to_none=True)
        return grads

    plain = step(None)
    backend, fake = _backend()
    grads = step(OffloadSession(backend, min_bytes=1024))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert not any("record_stream" in str(e) for e in fake.log)
    # Every event a store records is waited for by the compute stream before its
    # source could be reused (the drop), except the last group's (held, not dropped).
    recorded = [e[2] for e in fake.log if e[0] == "record"]
    waited = {e[2] for e in fake.log if e[0] == "wait_event"}
    assert len(recorded) == len(set(recorded)) == len(waited) + 1
    assert backend.host_bytes == 0


def test_without_a_gpu_the_backend_says_what_to_use_instead():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="HostCopyBackend"):
        CudaOffloadBackend("cuda")


def test_streamed_on_the_cuda_backend_waits_for_every_copy_before_its_bytes_are_used():
    from gradckpt.engine.offload.stream import run_streamed

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32))
                           for _ in range(3))  # fmt: skip
    x = torch.randn(64, 32)

    def step(session):
        h = x
        for i, b in enumerate(blocks):
            h = run_streamed(session, f"b{i}", b, (h,), {}, tuple(b.parameters())) if session \
                else b(h)  # fmt: skip
        h.sum().backward()
        grads = [p.grad.clone() for p in blocks.parameters()]
        blocks.zero_grad(set_to_none=True)
        return grads

    plain = step(None)
    backend, fake = _backend()
    grads = step(OffloadSession(backend, min_bytes=1024))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert not any("record_stream" in str(e) for e in fake.log)
    # Streamed, compute waits for each copy out at once (the source may then go as the
    # forward lets it) and for each copy back before its first use: every event recorded
    # is waited for, right after it is recorded for a store.
    recorded = [e[2] for e in fake.log if e[0] == "record"]
    waited = [e[2] for e in fake.log if e[0] == "wait_event"]
    assert recorded and sorted(recorded) == sorted(waited)
    stores = [i for i, e in enumerate(fake.log) if e[0] == "record"][: len(blocks)]
    assert all(fake.log[i + 2][0] == "wait_event" for i in stores)  # record, exit, wait
    assert backend.host_bytes == 0
