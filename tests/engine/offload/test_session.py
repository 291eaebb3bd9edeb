"""The offload engine with the host-copy backend: exact gradients, bytes, and event order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradckpt.engine.offload import OffloadSession, run_offloaded
from gradckpt.engine.offload.store import HostCopyBackend, HostOverBudgetError
from gradckpt.measure import MemoryTracker


def _blocks(n: int = 4, width: int = 64) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(4 * width, width))
        for _ in range(n)
    )  # fmt: skip


def _step(blocks: nn.ModuleList, x: torch.Tensor, session: OffloadSession | None, which=None):
    """One step from a fixed RNG state; returns the gradients and the tracker."""
    torch.manual_seed(1)
    with MemoryTracker(blocks) as tracker:
        h = x
        for i, block in enumerate(blocks):
            if session is not None and (which is None or i in which):
                keep = tuple(block.parameters())
                h = run_offloaded(session, f"b{i}", block, (h,), {}, keep)
            else:
                h = block(h)
        h.square().sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad(set_to_none=True)
    return grads, tracker


@pytest.fixture
def setup():
    return _blocks(), torch.randn(256, 64)


def test_gradients_bit_equal_and_peak_lower(setup):
    blocks, x = setup
    plain, plain_mt = _step(blocks, x, None)
    backend = HostCopyBackend()
    grads, mt = _step(blocks, x, OffloadSession(backend, min_bytes=1024))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert mt.peak_bytes < plain_mt.peak_bytes
    assert backend.stores > 0 and backend.loads > 0


def _saved_storage_bytes(blocks: nn.ModuleList, x: torch.Tensor, min_bytes: int) -> int:
    """Bytes of the distinct storages each block saves that it made itself (plain autograd)."""
    total = 0
    h = x
    for block in blocks:
        found: dict[int, int] = {}
        outside = {p.untyped_storage().data_ptr() for p in block.parameters()}
        outside.add(h.untyped_storage().data_ptr())

        def pack(t, found=found, outside=outside):
            storage = t.untyped_storage()
            if storage.data_ptr() not in outside and storage.nbytes() >= min_bytes:
                found[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = block(h)
        total += sum(found.values())
    return total


def test_host_bytes_are_the_moved_storages_and_all_freed_after_backward(setup):
    blocks, x = setup
    torch.manual_seed(1)
    expected = _saved_storage_bytes(blocks, x, 1024)
    backend = HostCopyBackend()
    session = OffloadSession(backend, min_bytes=1024)
    _step(blocks, x, session)
    stored = sum(detail for kind, _, detail in session.events if kind == "store")
    assert stored == expected > 0
    assert backend.peak_host_bytes == stored  # every group is on the host at backward start
    assert backend.host_bytes == 0


def test_event_order_stash_prefetch_and_cancel(setup):
    blocks, x = setup
    session = OffloadSession(HostCopyBackend(), min_bytes=1024)
    _step(blocks, x, session)
    assert session.events == [
        ("store", "b0", session.events[0][2]),
        ("store", "b1", session.events[1][2]),
        ("drop", "b0", None),  # the stash is one group deep: b0's sources go when b1 ends
        ("store", "b2", session.events[3][2]),
        ("drop", "b1", None),
        ("store", "b3", session.events[5][2]),
        ("drop", "b2", None),
        ("load", "b3", "still held"),  # backward reaches b3 first: its sources are used
        ("load", "b2", "prefetch"),  # ... and b2 comes back while b3's backward runs
        ("unpack", "b3", None),
        ("load", "b1", "prefetch"),
        ("unpack", "b2", None),
        ("load", "b0", "prefetch"),
        ("unpack", "b1", None),
        ("unpack", "b0", None),
    ]


def test_without_prefetch_every_load_waits_for_its_own_unpack(setup):
    blocks, x = setup
    plain, _ = _step(blocks, x, None)
    session = OffloadSession(HostCopyBackend(), min_bytes=1024, prefetch=False)
    grads, _ = _step(blocks, x, session)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    loads = [(name, why) for kind, name, why in session.events if kind == "load"]
    assert loads == [("b3", "still held"), ("b2", "demand"), ("b1", "demand"), ("b0", "demand")]
    order = [(k, n) for k, n, _ in session.events if k in ("load", "unpack")]
    for name in ("b2", "b1", "b0"):
        assert order.index(("load", name)) + 1 == order.index(("unpack", name))


def test_prefetch_holds_one_more_group_during_backward(setup):
    """The reload buffer of the next group is live one unit early: the price of overlap."""
    blocks, x = setup
    _, with_prefetch = _step(blocks, x, OffloadSession(HostCopyBackend(), min_bytes=1024))
    _, without = _step(
        blocks, x, OffloadSession(HostCopyBackend(), min_bytes=1024, prefetch=False)
    )
    assert with_prefetch.peak_bytes >= without.peak_bytes


def test_min_bytes_keeps_small_tensors_on_the_device(setup):
    blocks, x = setup
    backend = HostCopyBackend()
    session = OffloadSession(backend, min_bytes=256 * 256 * 4 + 1)  # larger than any saved one
    plain, _ = _step(blocks, x, None)
    grads, _ = _step(blocks, x, session)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert backend.stores == 0


def test_inputs_and_parameters_are_never_moved():
    lin = nn.Linear(512, 512)
    x = torch.randn(64, 512, requires_grad=True)
    backend = HostCopyBackend()
    session = OffloadSession(backend, min_bytes=1)
    out = run_offloaded(session, "lin", lin, (x,), {}, tuple(lin.parameters()))
    out.sum().backward()
    assert backend.stores == 0  # addmm saves only its input and weight


def test_views_of_one_storage_are_moved_once():
    def fn(x):
        y = x * 2  # one storage, saved below through two views
        a, b = y[:, :512], y[:, 512:]
        return (a.sin() + b.cos()).sum()

    x = torch.randn(8, 1024, requires_grad=True)
    fn(x).backward()
    plain, x.grad = x.grad, None
    backend = HostCopyBackend()
    session = OffloadSession(backend, min_bytes=1)
    run_offloaded(session, "f", fn, (x,), {}).backward()
    assert torch.equal(x.grad, plain)
    assert backend.stores == 1
    assert backend.peak_host_bytes == 8 * 1024 * 4


def test_in_place_change_of_a_saved_tensor_is_refused():
    session = OffloadSession(HostCopyBackend(), min_bytes=1)
    x = torch.randn(1000, requires_grad=True)

    def fn(x):
        y = x * 1.0
        z = y.exp()  # saves its output z
        out = z * 1.0
        z.add_(1)  # autograd's version check would fail: so does the offload's
        return out

    with pytest.raises(RuntimeError, match="modified in place"):
        run_offloaded(session, "f", fn, (x,), {})


def test_host_budget_is_enforced(setup):
    blocks, x = setup
    session = OffloadSession(HostCopyBackend(host_budget=100_000), min_bytes=1024)
    with pytest.raises(HostOverBudgetError, match="host budget of 100000"):
        _step(blocks, x, session)


def test_retain_graph_second_backward_loads_again(setup):
    blocks, x = setup
    session = OffloadSession(HostCopyBackend(), min_bytes=1024)
    torch.manual_seed(1)
    h = x
    for i, block in enumerate(blocks):
        h = run_offloaded(session, f"b{i}", block, (h,), {}, tuple(block.parameters()))
    loss = h.square().sum()
    first = torch.autograd.grad(loss, list(blocks.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(blocks.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert any(kind == "load" and why == "again" for kind, _, why in session.events)
