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


def _full_reads(monkeypatch, stream):
    reads = []
    real = type(stream).get_state
    monkeypatch.setattr(stream, "get_state", lambda: reads.append(1) or real(stream))
    return reads


@pytest.mark.parametrize("name", ["python", "numpy"])
def test_host_state_is_read_in_full_only_when_it_moved_since_the_last_read(monkeypatch, name):
    # Reading a full host RNG state costs 10-45 us; a region reads the stream's
    # raw words instead (about 1 us) and reuses the last full read while they
    # have not moved. After the forward, the words tell it drew nothing.
    from gradckpt.engine import host_rng

    if name == "numpy":
        np = pytest.importorskip("numpy")
        np.random.seed(4)  # nothing cached: the words tell every draw
    stream = host_rng.PYTHON if name == "python" else host_rng.NUMPY
    if stream.words() is None or stream.capture()[1] is None:
        pytest.skip(f"this {name} generator's words cannot be read in place")
    reads = _full_reads(monkeypatch, stream)
    frames = []

    def quiet(x):
        frames.append(gradckpt.engine.active_frame()[0])
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    outs = [gradckpt.checkpoint(quiet, x) for _ in range(3)]
    assert reads == []  # the words had not moved since the capture above
    assert all(getattr(f._state, f"{name}_rng") is None for f in frames)
    sum(o.sum() for o in outs).backward()
    assert reads == []  # and nothing is replayed
    draw = random.random if name == "python" else np.random.rand
    draw()
    gradckpt.checkpoint(quiet, x)
    assert len(reads) == 1  # the stream moved: read once, at the capture


def test_a_draw_that_takes_python_s_cached_gaussian_is_seen():
    # random.gauss() draws two normals and keeps one in gauss_next; the next
    # call takes it without moving the words, so the mark includes it.
    random.seed(7)
    random.gauss()

    def draws(x):
        return (x * random.gauss()).sin()  # sin saves its input: the recompute redraws

    x = torch.randn(3, requires_grad=True)
    state = random.getstate()
    expected = torch.autograd.grad(draws(x).sum(), x)[0]
    random.setstate(state)
    (got,) = torch.autograd.grad(gradckpt.checkpoint(draws, x).sum(), x)
    assert torch.equal(got, expected)
