"""Streamed offload with the host-copy backend: exact gradients, a lower backward, the order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradckpt.engine.offload import OffloadSession
from gradckpt.engine.offload.store import HostCopyBackend
from gradckpt.engine.offload.stream import run_streamed
from gradckpt.measure import MemoryTracker


def _blocks(n: int = 3, width: int = 64) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(4 * width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(n)
    )  # fmt: skip


def _step(blocks, x, session=None, run=run_streamed):
    torch.manual_seed(1)
    with MemoryTracker(blocks) as tracker:
        h = x
        for i, block in enumerate(blocks):
            if session is None:
                h = block(h)
            else:
                h = run(session, f"b{i}", block, (h,), {}, tuple(block.parameters()))
        h.square().sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad(set_to_none=True)
    return grads, tracker


@pytest.fixture
def setup():
    return _blocks(), torch.randn(256, 64)


def test_gradients_bit_equal_and_every_host_byte_freed(setup):
    blocks, x = setup
    plain, _ = _step(blocks, x)
    backend = HostCopyBackend()
    session = OffloadSession(backend, min_bytes=1024)
    grads, _ = _step(blocks, x, session)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert backend.stores > 0 and backend.loads == backend.stores
    assert backend.peak_host_bytes > 0 and backend.host_bytes == 0


def test_the_step_holds_less_than_grouped_offload(setup):
    # Grouped offload brings a block's saved tensors back together, so its backward
    # holds them all; streamed, only those in use and the next one.
    from gradckpt.engine.offload import run_offloaded

    blocks, x = setup
    _, plain = _step(blocks, x)
    _, grouped = _step(blocks, x, OffloadSession(HostCopyBackend(), min_bytes=1024),
                       run=run_offloaded)  # fmt: skip
    _, streamed = _step(blocks, x, OffloadSession(HostCopyBackend(), min_bytes=1024))
    assert streamed.peak_bytes < grouped.peak_bytes < plain.peak_bytes


def test_each_storage_comes_back_on_its_first_use_or_one_ahead(setup):
    blocks, x = setup
    session = OffloadSession(HostCopyBackend(), min_bytes=1024)
    _step(blocks, x, session)
    loads = [(unit, why) for kind, unit, why in session.events if kind == "load"]
    stores = {unit: n for kind, unit, n in session.events if kind == "store"}
    assert set(stores) == {"b0", "b1", "b2"} and all(n > 0 for n in stores.values())
    # Backward reaches b2 first; each block's first storage is loaded on demand, the
    # next ones were prefetched by the use before them.
    assert [u for u, why in loads if why == "demand"] == ["b2", "b1", "b0"]
    assert all(why in ("demand", "prefetch") for _, why in loads)
    assert sum(why == "prefetch" for _, why in loads) > 0
    first_b1 = next(i for i, (u, _) in enumerate(loads) if u == "b1")
    assert all(u == "b2" for u, _ in loads[:first_b1])


def test_without_prefetch_every_load_waits_for_its_use(setup):
    blocks, x = setup
    session = OffloadSession(HostCopyBackend(), min_bytes=1024, prefetch=False)
    plain, _ = _step(blocks, x)
    grads, _ = _step(blocks, x, session)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert {why for kind, _, why in session.events if kind == "load"} == {"demand"}


def test_the_output_stays_on_the_device():
    session = OffloadSession(HostCopyBackend(), min_bytes=1)
    x = torch.randn(64, 64, requires_grad=True)
    out = run_streamed(session, "exp", torch.exp, (x,), {})  # exp saves its output
    assert session.backend.stores == 1 and session.backend.host_bytes == 0
    out.sum().backward()
    assert torch.equal(x.grad, torch.exp(x.detach()))
    assert session.backend.loads == 0


def test_a_storage_saved_again_after_an_in_place_write_is_refused():
    session = OffloadSession(HostCopyBackend(), min_bytes=1)

    def body(x):
        y = x * 2
        z = y * x  # saves y: copied to host now
        y.add_(1)  # the copy is older than y
        return (z + y * x).sum()  # saves y again: one storage, two versions

    x = torch.randn(32, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified in place"):
        run_streamed(session, "u", body, (x,), {})


def test_a_write_after_the_only_save_leaves_the_saved_values():
    # Plain autograd refuses this backward (a saved tensor changed); streamed, the copy
    # was taken at the save, so backward gets the values the forward used.
    session = OffloadSession(HostCopyBackend(), min_bytes=1)

    def body(x):
        y = x * 2
        z = y * x
        y.add_(1)
        return z.sum()

    x = torch.randn(32, 32, requires_grad=True)
    run_streamed(session, "u", body, (x,), {}).backward()
    assert torch.equal(x.grad, (x.detach() * 2) + x.detach() * 2)


def test_a_second_backward_with_retain_graph_loads_again():
    session = OffloadSession(HostCopyBackend(), min_bytes=1)
    x = torch.randn(64, 64, requires_grad=True)

    def body(x):
        return (x.exp() * 3).sin().sum()

    loss = run_streamed(session, "u", body, (x,), {})
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert torch.equal(x.grad, 2 * first)
    assert any(why == "again" for kind, _, why in session.events if kind == "load")
