"""A checkpointed region's kept input offloaded (host-copy backend): exact, freed, brought back."""

from __future__ import annotations

import torch
from torch import nn

from gradckpt.engine.checkpoint import run_checkpointed
from gradckpt.engine.offload import OffloadSession, run_boundary_offloaded
from gradckpt.engine.offload.store import HostCopyBackend
from gradckpt.measure import MemoryTracker


def _blocks(n: int = 4, width: int = 64) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(4 * width, width))
        for _ in range(n)
    )  # fmt: skip


def _step(blocks, x, session=None):
    """One step, every block recomputed (its input offloaded through ``session`` if given)."""
    torch.manual_seed(1)
    with MemoryTracker(blocks) as forward:  # what the forward leaves for the backward
        h = x.clone()
        for i, block in enumerate(blocks):
            region = lambda block=block, h=h, i=i: run_checkpointed(block, (h,), {}, name=f"b{i}")  # noqa: E731
            if session is None:
                h = region()
            else:
                keep = tuple(block.parameters())
                h = run_boundary_offloaded(session, f"b{i}", region, h, keep)
    h.square().sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad(set_to_none=True)
    return grads, forward


def test_offloaded_inputs_give_the_same_gradients_and_a_lower_peak():
    blocks, x = _blocks(n=6), torch.randn(512, 64)
    plain, plain_mt = _step(blocks, x)
    backend = HostCopyBackend()
    session = OffloadSession(backend, min_bytes=1024)
    grads, mt = _step(blocks, x, session)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))  # dropout replayed too
    # The forward left the six block inputs of 128 KiB on the device (and the output);
    # now only the last block's, which is used in place: five moved to host.
    assert plain_mt.end_bytes - mt.end_bytes == 5 * x.nbytes
    # Block 0's input is the step's own input (held by the caller): made outside the step,
    # it is moved all the same (the planner does not offer it); the others too.
    assert backend.stores == 6 and backend.host_bytes == 0
    assert backend.peak_host_bytes == 6 * x.nbytes


def test_each_input_is_back_before_its_recompute_and_the_last_never_left():
    blocks, x = _blocks(n=3), torch.randn(256, 64)
    session = OffloadSession(HostCopyBackend(), min_bytes=1024)
    _step(blocks, x, session)
    assert session.events == [
        ("store", "b0", x.nbytes), ("store", "b1", x.nbytes), ("drop", "b0", None),
        ("store", "b2", x.nbytes), ("drop", "b1", None),
        ("load", "b2", "still held"), ("load", "b1", "prefetch"), ("unpack", "b2", None),
        ("load", "b0", "prefetch"), ("unpack", "b1", None), ("unpack", "b0", None),
    ]  # fmt: skip


def test_only_the_named_input_moves():
    blocks, x = _blocks(n=2), torch.randn(256, 64)
    shared = torch.randn(256, 64)  # a second input, held by the caller: stays
    backend = HostCopyBackend()
    session = OffloadSession(backend, min_bytes=1024)
    h = x
    for i, block in enumerate(blocks):
        region = lambda block=block, h=h, i=i: run_checkpointed(  # noqa: E731
            lambda a, b: block(a) + b, (h, shared), {}, name=f"b{i}"
        )
        h = run_boundary_offloaded(session, f"b{i}", region, h, tuple(block.parameters()))
    h.sum().backward()
    assert backend.peak_host_bytes == 2 * x.nbytes  # the two chain inputs, not `shared`


def test_a_second_backward_over_the_graph_loads_the_inputs_again():
    blocks, x = _blocks(n=3), torch.randn(256, 64)
    session = OffloadSession(HostCopyBackend(), min_bytes=1024)
    torch.manual_seed(1)
    h = x
    for i, block in enumerate(blocks):
        region = lambda block=block, h=h, i=i: run_checkpointed(block, (h,), {}, name=f"b{i}")  # noqa: E731
        h = run_boundary_offloaded(session, f"b{i}", region, h, tuple(block.parameters()))
    loss = h.square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad(set_to_none=True)
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, blocks.parameters()))
    assert ("load", "b0", "again") in session.events  # brought back a second time
