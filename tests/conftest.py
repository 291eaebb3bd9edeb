"""Helpers the test folders share, handed out as fixtures.

pytest imports test files with ``--import-mode=importlib``, so a helper module
beside them cannot be imported; each fixture here returns the helper function.

* ``loss_and_grads(ex, seed=1)``: one seeded training step of a
  :class:`gradckpt.testing.Example`, its loss and every parameter's gradient.
* ``assert_steps_close(ref, got, atol)``: two such results agree within ``atol``.
* ``blocks_plan(ex, mode="recompute", blocks=None)``: a plan that gives the
  example's blocks (or ``blocks``) ``mode`` and keeps every other unit.
* ``peak_and_grads(model, step, seed=0)``: one seeded ``step().backward()``, its
  whole peak at the allocator (the model's state included) and its gradients.
* ``every_block_peak(ex)``: that peak with ``torch.utils.checkpoint`` around each of
  ``ex.block_paths`` (what torch's per-block checkpointing reaches).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.planning import Plan, UnitChoice
from gradckpt.profiling import find_units, model_fingerprint
from gradckpt.testing import Example

# One torch thread per process, suite-wide (a run's own OMP_NUM_THREADS wins). On a
# 2-core machine two OpenMP threads per process wait on each other whenever any
# other process runs (the rank scripts, the benchmark scripts' workers, a second
# job): tests/apply took 217 s on two threads beside one busy process and 53 s on
# one. The variable passes it to the subprocesses tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

Step = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _loss_and_grads(ex: Example, seed: int = 1) -> Step:
    """``ex.loss_fn().backward()`` from ``seed``: the detached loss and a copy of each gradient.

    Gradients are cleared before (nothing accumulates from an earlier step) and after.
    """
    ex.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = ex.loss_fn()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in ex.model.named_parameters()}
    ex.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_steps_close(ref: Step, got: Step, atol: float) -> None:
    """The same parameters, and loss and gradients within ``atol`` (no relative slack)."""
    (loss0, grads0), (loss1, grads1) = ref, got
    torch.testing.assert_close(loss1, loss0, atol=atol, rtol=0)
    assert grads0.keys() == grads1.keys()
    for k in grads0:
        torch.testing.assert_close(grads1[k], grads0[k], atol=atol, rtol=0, msg=k)


def _blocks_plan(ex: Example, mode: str = "recompute", blocks: Sequence[str] | None = None) -> Plan:
    """Every unit of ``ex.model`` kept, but ``blocks`` (default: all of ``ex.block_paths``) in ``mode``."""
    chosen = ex.block_paths if blocks is None else blocks
    items = [
        UnitChoice(u.path, mode if u.path in chosen else "keep")
        for u in find_units(ex.model, ex.block_paths)
    ]
    return Plan(tuple(items), model_fingerprint(ex.model))


def _peak_and_grads(
    model: nn.Module, step: Callable[[], torch.Tensor], seed: int = 0
) -> tuple[int, dict[str, torch.Tensor]]:
    """``step().backward()`` from ``seed``: the model's parameters and buffers plus the
    allocator's peak during it (kernel workspaces included), and a copy of each gradient
    it made (parameters it did not reach have none). Gradients are cleared before and after.
    """
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with AllocatorTracker() as allocator:
        step().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return state_bytes(model) + allocator.peak_bytes, grads


def _every_block_peak(ex: Example, seed: int = 0) -> int:
    """The allocator peak of ``ex``'s step with torch's checkpoint around each of its blocks."""
    modules = dict(ex.model.named_modules())
    for path in ex.block_paths:
        forward = modules[path].forward
        modules[path].forward = lambda *a, f=forward: torch_checkpoint.checkpoint(
            f, *a, use_reentrant=False
        )
    try:
        peak, _ = _peak_and_grads(ex.model, ex.loss_fn, seed)
    finally:
        for path in ex.block_paths:
            modules[path].__dict__.pop("forward")
    return peak


@pytest.fixture(scope="session")
def every_block_peak():
    """:func:`_every_block_peak`."""
    return _every_block_peak


@pytest.fixture(scope="session")
def loss_and_grads():
    """:func:`_loss_and_grads`."""
    return _loss_and_grads


@pytest.fixture(scope="session")
def assert_steps_close():
    """:func:`_assert_steps_close`."""
    return _assert_steps_close


@pytest.fixture(scope="session")
def blocks_plan():
    """:func:`_blocks_plan`."""
    return _blocks_plan


@pytest.fixture(scope="session")
def peak_and_grads():
    """:func:`_peak_and_grads`."""
    return _peak_and_grads


@pytest.fixture
def one_thread():
    """torch on one thread for the test: two OpenMP threads on a shared 2-core
    machine spin against the other processes (HF, Lightning, PEFT, AMP,
    whole-step and tune tests); and one thread is what thread CPU time measures faithfully."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
