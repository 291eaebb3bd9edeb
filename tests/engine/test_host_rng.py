"""Python's ``random`` and NumPy's global RNG are replayed in the recompute (beyond torch).

A checkpointed block that draws from them (a random crop size, token dropping
or stochastic depth decided in Python) must draw the same numbers when it is
recomputed, or its gradients belong to another forward. torch's checkpoint
replays only torch's RNG; gradckpt also replays these two, and leaves the
caller's streams where they were. NumPy is optional: its part is skipped
when it is not installed (gradckpt never imports it itself).
"""

from __future__ import annotations

import functools
import random
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt


def python_scaled(x: torch.Tensor) -> torch.Tensor:
    keep = random.random()
    width = random.randint(1, x.numel())
    return (x[:width] * keep).sin().sum() * x


def run(checkpoint, fn, seed_all, x):
    seed_all(0)
    out = checkpoint(fn, x) if checkpoint is not None else fn(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    return grad


def seed_python(seed: int) -> None:
    random.seed(seed)


def test_python_random_replayed_and_caller_stream_kept():
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    expected = run(None, python_scaled, seed_python, x)
    assert torch.equal(run(gradckpt.checkpoint, python_scaled, seed_python, x), expected)

    random.seed(1)
    out = gradckpt.checkpoint(python_scaled, x)
    after_forward = random.getstate()
    out.sum().backward()
    assert random.getstate() == after_forward  # the recompute gave the caller's stream back


def test_torch_checkpoint_does_not_replay_python_random():
    # The flaw this fixes is real: torch's checkpoint gets another gradient here.
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def scaled(t):
        return t * random.random() * t

    expected = run(None, scaled, seed_python, x)
    theirs = functools.partial(torch_checkpoint, use_reentrant=False)
    assert not torch.equal(run(theirs, scaled, seed_python, x), expected)
    assert torch.equal(run(gradckpt.checkpoint, scaled, seed_python, x), expected)


def test_numpy_global_random_replayed_and_caller_stream_kept():
    np = pytest.importorskip("numpy")

    def fn(x):
        return x * float(np.random.rand()) * x

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    expected = run(None, fn, np.random.seed, x)
    assert torch.equal(run(gradckpt.checkpoint, fn, np.random.seed, x), expected)

    np.random.seed(1)
    out = gradckpt.checkpoint(fn, x)
    after_forward = np.random.get_state()[1].copy()
    out.sum().backward()
    assert (np.random.get_state()[1] == after_forward).all()


def test_preserve_rng_state_false_leaves_python_random_alone():
    calls = []

    def fn(x):
        calls.append(random.random())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    random.seed(2)
    gradckpt.checkpoint(fn, x, preserve_rng_state=False).sum().backward()
    assert calls[0] != calls[1]  # not replayed: the documented opt-out


def test_regions_that_draw_nothing_skip_the_host_replay():
    # Reading and writing a NumPy state costs tens of microseconds: a region
    # that drew nothing from the host RNGs forgets their states after its forward.
    np = sys.modules.get("numpy")  # checked only where NumPy is installed and imported
    frames = []

    def quiet(x):
        frames.append(gradckpt.engine.active_frame()[0])
        return x.sin()

    def noisy(x):
        frames.append(gradckpt.engine.active_frame()[0])
        drawn = random.random() * (float(np.random.rand()) if np is not None else 1.0)
        return x * drawn

    x = torch.randn(3, requires_grad=True)
    keep = [gradckpt.checkpoint(quiet, x), gradckpt.checkpoint(noisy, x)]
    quiet_state, noisy_state = (frame._state for frame in frames)
    assert quiet_state.python_rng is None and quiet_state.numpy_rng is None
    assert noisy_state.python_rng is not None
    assert (noisy_state.numpy_rng is not None) == (np is not None)
    del keep


def _numpy_draws_replayed(np, draw) -> None:
    def fn(x):
        return x * float(draw()) * x

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for cached in (False, True):
        np.random.seed(3)
        # One normal draw leaves the pair's second Gaussian cached; a uniform one does not.
        (np.random.standard_normal if cached else np.random.rand)()
        state = np.random.get_state()
        expected = torch.autograd.grad(fn(x).sum(), x)[0]  # plain, from this state
        np.random.set_state(state)
        out = gradckpt.checkpoint(fn, x)
        (got,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(got, expected), f"{draw.__name__}, cached Gaussian: {cached}"


def test_numpy_draws_are_replayed_whether_or_not_a_gaussian_is_cached():
    # The check for "did the region draw" reads NumPy's raw generator words
    # when no Gaussian is cached; a draw that only takes the cached Gaussian
    # leaves those words alone, so then the full state is compared. Both must
    # still replay the region's draws.
    np = pytest.importorskip("numpy")
    _numpy_draws_replayed(np, np.random.standard_normal)
    _numpy_draws_replayed(np, np.random.rand)


def test_numpy_state_read_once_per_region_when_no_gaussian_is_cached(monkeypatch):
    np = pytest.importorskip("numpy")
    from gradckpt.engine import state as engine_state

    if engine_state._numpy_words() is None:
        pytest.skip("this NumPy's generator words cannot be read in place")
    np.random.seed(4)  # nothing cached
    reads = []
    real = engine_state._numpy_state
    monkeypatch.setattr(engine_state, "_numpy_state", lambda: reads.append(1) or real())
    frames = []

    def quiet(x):
        frames.append(gradckpt.engine.active_frame()[0])
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    out = gradckpt.checkpoint(quiet, x)
    assert len(reads) == 1  # at capture only: the words told that nothing was drawn
    assert frames[0]._state.numpy_rng is None
    out.sum().backward()
    assert len(reads) == 1  # and nothing is replayed
