"""Drop-in compatibility: the same behaviours run against torch's checkpoint and ours.

Each behaviour below takes ``ckpt``, a function with the signature of
``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **options)``,
and asserts what a user of non-reentrant checkpointing relies on. Every
behaviour runs twice: against ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False`` and against ``gradckpt.checkpoint``. gradckpt must pass
all but :data:`DELIBERATE` (torch's behaviour where gradckpt differs on purpose,
each with its reason); torch must pass all but :data:`BEYOND_TORCH`, which it is
known to fail (they are where gradckpt goes further). Both sets are strict xfail
for the implementation that fails them, so a change on either side is noticed.

The behaviours were chosen after reading what torch's own tests of non-reentrant
checkpointing exercise (``test/test_autograd.py``, ``test/test_utils.py``); they
are written here from scratch, on tiny tensors, so the module runs in seconds.
The README's comparison with torch quotes the counts this module yields.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gradckpt
from gradckpt.measure import count_ops

aten = torch.ops.aten
Ckpt = Callable[..., Any]

IMPLS: dict[str, Ckpt] = {
    "torch": functools.partial(tc.checkpoint, use_reentrant=False),
    "gradckpt": gradckpt.checkpoint,
}

BEHAVIOURS: dict[str, Callable[[Ckpt], None]] = {}
#: Behaviours torch's checkpoint fails today and gradckpt passes.
BEYOND_TORCH = {
    "batchnorm_stats_once",
    "python_random_replayed",
    "numpy_random_replayed",
    "nested_double_backward_in_a_graph_exec_group",
}

#: torch's behaviours where gradckpt differs on purpose, with the reason (the xfail's).
DELIBERATE = {
    "omitted_use_reentrant_warns": (
        "gradckpt has only the non-reentrant mechanism, so there is no default to warn "
        "about; use_reentrant=True is refused with a ValueError instead"
    ),
    "global_toggle_beats_the_keyword": (
        "an explicit early_stop=/debug= keyword says what that call does and wins over "
        "torch's set_checkpoint_early_stop/set_checkpoint_debug_enabled (None defers to them)"
    ),
    "debug_with_context_fn_is_refused": (
        "gradckpt's debug=True logs op names below the context's modes, so it works "
        "with a context_fn (SAC) instead of refusing the pair"
    ),
}


def behaviour(fn: Callable[[Ckpt], None]) -> Callable[[Ckpt], None]:
    BEHAVIOURS[fn.__name__] = fn
    return fn


def leaf(*shape: int, seed: int = 0, requires_grad: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)


def grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.sum(), inputs, allow_unused=True)


def assert_equal(a: Any, b: Any) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).exp().sin()


# ------------------------------------------------------------------ basics


@behaviour
def grads_match_plain(ckpt):
    x, w = leaf(3, 4), leaf(4, 4, seed=1)
    assert_equal(grads(ckpt(body, x, w), [x, w]), grads(body(x, w), [x, w]))


@behaviour
def outputs_match_plain(ckpt):
    x, w = leaf(3, 4), leaf(4, 4, seed=1)
    assert torch.equal(ckpt(body, x, w), body(x, w))


@behaviour
def kwargs_reach_fn(ckpt):
    def fn(x, *, scale, shift=0.0):
        return (x * scale + shift).sin()

    x = leaf(5)
    (g,) = grads(ckpt(fn, x, scale=3.0, shift=1.0), [x])
    (ref,) = grads(fn(x, scale=3.0, shift=1.0), [x])
    assert torch.equal(g, ref)


@behaviour
def non_tensor_outputs(ckpt):
    def fn(x):
        return x.sin(), 7, None, "label", {"y": x.cos()}

    x = leaf(4)
    a, seven, none, label, d = ckpt(fn, x)
    assert (seven, none, label) == (7, None, "label")
    (g,) = grads(a + d["y"], [x])
    assert torch.equal(g, x.detach().cos() - x.detach().sin())


@behaviour
def tensors_inside_containers(ckpt):
    def fn(pair, extra):
        return (pair[0] * pair[1]).sin() + extra["b"].exp()

    x, y, b = leaf(3), leaf(3, seed=1), leaf(3, seed=2)
    got = grads(ckpt(fn, [x, y], {"b": b}), [x, y, b])
    assert_equal(got, grads(fn([x, y], {"b": b}), [x, y, b]))


@behaviour
def no_tensor_inputs(ckpt):
    def fn(a, b, scale):
        return (a + b) * scale, "done"

    assert ckpt(fn, 1.5, 2.5, 2) == (8.0, "done")


@behaviour
def returns_an_input_and_mixed_outputs(ckpt):
    def fn(t1, t2, scale, t3):
        t4 = t1 + t2 * t3
        t4 *= scale
        return scale, t4, None, True, "bar", t1

    t1, t2, t3 = leaf(5), leaf(5, seed=1), leaf(5, seed=2, requires_grad=False)
    res = ckpt(fn, t1, t2, 3, t3)
    assert res[0] == 3 and res[2] is None and res[3] is True and res[4] == "bar"
    assert torch.equal(res[5], t1)
    got = grads(res[1] + res[5], [t1, t2])
    plain = fn(t1, t2, 3, t3)
    assert_equal(got, grads(plain[1] + plain[5], [t1, t2]))


@behaviour
def output_without_grad(ckpt):
    def fn(x):
        return x.detach().sin(), x.sum().item()

    x = leaf(3)
    out, value = ckpt(fn, x)
    assert not out.requires_grad and isinstance(value, float)


@behaviour
def input_without_grad(ckpt):
    x, w = leaf(3, 4, requires_grad=False), leaf(4, 4, seed=1)
    out = ckpt(body, x, w)
    out.sum().backward()
    assert x.grad is None
    ref = w.grad.clone()
    w.grad = None
    body(x, w).sum().backward()
    assert torch.equal(w.grad, ref)


@behaviour
def module_parameters_get_grads(ckpt):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)).double()
    x = leaf(3, 4)
    got = grads(ckpt(net, x), [x, *net.parameters()])
    assert_equal(got, grads(net(x), [x, *net.parameters()]))


@behaviour
def no_grad_runs_once_and_builds_nothing(ckpt):
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin()

    with torch.no_grad():
        out = ckpt(fn, leaf(3))
    assert out.grad_fn is None and len(calls) == 1


@behaviour
def runs_fn_twice_per_step(ckpt):
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin().exp()

    x = leaf(3)
    ckpt(fn, x).sum().backward()
    assert len(calls) == 2


@behaviour
def nested_checkpoints(ckpt):
    def inner(x):
        return x.sin().exp()

    def outer(x):
        return ckpt(inner, x.cos()).tanh()

    x = leaf(4)
    (g,) = grads(ckpt(outer, x), [x])
    (ref,) = grads(inner(x.cos()).tanh(), [x])
    assert torch.equal(g, ref)


@behaviour
def checkpoint_sequential_matches_plain(ckpt):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)]).double()
    x = leaf(2, 4)
    if ckpt is IMPLS["torch"]:
        out = tc.checkpoint_sequential(net, 2, x, use_reentrant=False)
    else:
        out = gradckpt.checkpoint_sequential(net, 2, x)
    assert_equal(grads(out, [x, *net.parameters()]), grads(net(x), [x, *net.parameters()]))


# ------------------------------------------------------------------ autograd


@behaviour
def autograd_grad_wrt_inputs(ckpt):
    x, w = leaf(3, 4), leaf(4, 4, seed=1)
    (g,) = torch.autograd.grad(ckpt(body, x, w).sum(), [w])
    (ref,) = torch.autograd.grad(body(x, w).sum(), [w])
    assert torch.equal(g, ref)


@behaviour
def backward_with_inputs_subset(ckpt):
    x, w = leaf(3, 4), leaf(4, 4, seed=1)
    ckpt(body, x, w).sum().backward(inputs=[x])
    assert w.grad is None
    (ref,) = torch.autograd.grad(body(x, w).sum(), [x])
    assert torch.equal(x.grad, ref)


@behaviour
def retain_graph_backward_twice(ckpt):
    x, w = leaf(3, 4), leaf(4, 4, seed=1)
    out = ckpt(body, x, w)
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    body(x, w).sum().backward()
    (ref,) = torch.autograd.grad(body(x, w).sum(), [x])
    assert torch.equal(x.grad, 3 * ref)


@behaviour
def separate_backward_per_output(ckpt):
    def fn(x):
        return x.sin().exp(), x.cos().tanh()

    x = leaf(4)
    a, b = ckpt(fn, x)
    (ga,) = torch.autograd.grad(a.sum(), [x])
    (gb,) = torch.autograd.grad(b.sum(), [x])
    pa, pb = fn(x)
    assert torch.equal(ga, grads(pa, [x])[0]) and torch.equal(gb, grads(pb, [x])[0])


@behaviour
def double_backward(ckpt):
    x = leaf(4)
    (g,) = torch.autograd.grad(ckpt(lambda t: t.sin().exp(), x).sum(), x, create_graph=True)
    (ref,) = torch.autograd.grad(x.sin().exp().sum(), x, create_graph=True)
    assert torch.equal(grads(g, [x])[0], grads(ref, [x])[0])


@behaviour
def backward_inside_the_region(ckpt):
    def fn(x):
        y = x.sin().exp()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return g * y

    x = leaf(4)
    assert torch.equal(grads(ckpt(fn, x), [x])[0], grads(fn(x), [x])[0])


def _grad_of(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def g(x):
        return torch.autograd.grad(f(x).sum(), x, create_graph=True)[0]

    return g


def _cube(x):
    return (x.sin() * x.exp()).cos()


@behaviour
def nested_double_backward_c_grad_c(ckpt):
    x = leaf(4)
    out = ckpt(_grad_of(lambda t: ckpt(_cube, t)), x)
    assert torch.equal(grads(out, [x])[0], grads(_grad_of(_cube)(x), [x])[0])


@behaviour
def nested_double_backward_c_grad_grad_c(ckpt):
    x = leaf(4)
    out = ckpt(_grad_of(_grad_of(lambda t: ckpt(_cube, t))), x)
    assert torch.equal(grads(out, [x])[0], grads(_grad_of(_grad_of(_cube))(x), [x])[0])


@behaviour
def grad_of_checkpointed_grad_of_checkpoint(ckpt):
    x = leaf(4)
    out = ckpt(_grad_of(lambda t: ckpt(_cube, t)), x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (ref,) = torch.autograd.grad(_grad_of(_cube)(x).sum(), x, create_graph=True)
    assert torch.equal(grads(g, [x])[0], grads(ref, [x])[0])


class _Scale(torch.autograd.Function):
    """Saves its frozen weight; backward checks it gets the very object back."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.expected = w
        return x * w

    @staticmethod
    def backward(ctx, grad):
        _, w = ctx.saved_tensors
        assert w is ctx.expected
        assert isinstance(w, nn.Parameter) and w.quant_state == "nf4"
        return grad * w, None


@behaviour
def custom_function_grads(ckpt):
    w = nn.Parameter(leaf(4, seed=1, requires_grad=False), requires_grad=False)
    w.quant_state = "nf4"
    x = leaf(4)
    got = grads(ckpt(lambda a, b: _Scale.apply(a.sin(), b).exp(), x, w), [x])
    assert torch.equal(got[0], grads(_Scale.apply(x.sin(), w).exp(), [x])[0])


@behaviour
def frozen_input_keeps_identity(ckpt):
    # The QLoRA pattern: quantization state rides on the frozen weight object.
    w = nn.Parameter(leaf(4, seed=1, requires_grad=False), requires_grad=False)
    w.quant_state = "nf4"
    x = leaf(4)
    ckpt(lambda a, b: _Scale.apply(a, b).sin(), x, w).sum().backward()  # asserts inside
    assert x.grad is not None


@behaviour
def double_unpack_is_refused(ckpt):
    class ReadTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            first = ctx.saved_tensors
            again = ctx.saved_tensors
            return grad * 2 + 0 * (first[0] + again[0])

    out = ckpt(lambda t: ReadTwice.apply(t.sin()), leaf(3))
    with pytest.raises(tc.CheckpointError, match="already unpacked once"):
        out.sum().backward()


@behaviour
def inplace_change_of_saved_input_is_caught(ckpt):
    x = leaf(4)
    h = x * 1.0
    out = ckpt(lambda t: t.sin(), h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError):
        out.sum().backward()


# ------------------------------------------------------------------ early stop and toggles


def _tail_counter() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[int]]:
    calls = []

    def fn(x):
        y = x.sin()  # the last op that saves a tensor
        calls.append(1)  # reached in the recompute only without early stop
        return y * 2.0

    return fn, calls


@behaviour
def early_stop_skips_the_tail(ckpt):
    fn, calls = _tail_counter()
    ckpt(fn, leaf(3)).sum().backward()
    assert len(calls) == 1


@behaviour
def early_stop_false_runs_the_tail(ckpt):
    fn, calls = _tail_counter()
    ckpt(fn, leaf(3), early_stop=False).sum().backward()
    assert len(calls) == 2


@behaviour
def set_checkpoint_early_stop_toggle(ckpt):
    fn, calls = _tail_counter()
    with tc.set_checkpoint_early_stop(False):
        out = ckpt(fn, leaf(3))
    out.sum().backward()
    assert len(calls) == 2


def _changes_shape_in_recompute() -> Callable[[torch.Tensor], torch.Tensor]:
    calls = []

    def fn(x):
        calls.append(1)
        t = x if len(calls) == 1 else x[:2]
        return t.sin().sum() * x

    return fn


@behaviour
def metadata_mismatch_raises_checkpoint_error(ckpt):
    out = ckpt(_changes_shape_in_recompute(), leaf(3))
    with pytest.raises(tc.CheckpointError, match="have different metadata"):
        out.sum().backward()


@behaviour
def fewer_tensors_in_recompute_raises(ckpt):
    calls = []

    def fn(x):
        calls.append(1)
        y = x.sin()
        return y.exp() if len(calls) == 1 else y * 2.0

    out = ckpt(fn, leaf(3), early_stop=False)
    with pytest.raises(tc.CheckpointError, match="A different number of tensors was saved"):
        out.sum().backward()


@behaviour
def more_tensors_in_recompute_raises_in_torchs_words(ckpt):
    calls = []

    def fn(x):
        calls.append(1)
        y = x.sin()
        return y if len(calls) == 1 else y.exp().exp()

    out = ckpt(fn, leaf(3), early_stop=False)
    # torch's own tests match its message case-sensitively.
    with pytest.raises(tc.CheckpointError, match="trying to save more tensors during recomputation"):
        out.sum().backward()


@behaviour
def determinism_check_none_skips_the_check(ckpt):
    x = leaf(3, 4, requires_grad=True)
    w = leaf(4, 4, seed=1)
    (g,) = grads(ckpt(body, x, w, determinism_check="none"), [x])
    assert torch.equal(g, grads(body(x, w), [x])[0])


@behaviour
def unknown_determinism_check_is_a_value_error(ckpt):
    with pytest.raises(ValueError, match="determinism_check"):
        ckpt(body, leaf(3, 4), leaf(4, 4), determinism_check="strict")


@behaviour
def set_checkpoint_debug_enabled_toggle(ckpt):
    with tc.set_checkpoint_debug_enabled(True):
        out = ckpt(_changes_shape_in_recompute(), leaf(3))
    with pytest.raises(tc.CheckpointError) as info:
        out.sum().backward()
    assert "sin.default" in str(info.value)  # the op logs debug mode adds


# ------------------------------------------------------------------ RNG, autocast, SAC


@behaviour
def dropout_replayed(ckpt):
    def fn(x):
        return nn.functional.dropout(x.sin(), 0.5, training=True).exp()

    x = leaf(64)
    torch.manual_seed(3)
    (g,) = grads(ckpt(fn, x), [x])
    torch.manual_seed(3)
    (ref,) = grads(fn(x), [x])
    assert torch.equal(g, ref)


@behaviour
def caller_rng_stream_untouched_by_recompute(ckpt):
    def fn(x):
        return nn.functional.dropout(x, 0.5, training=True).sin()

    x = leaf(16)
    torch.manual_seed(5)
    out = ckpt(fn, x)
    expected = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), expected)


@behaviour
def autocast_replayed(ckpt):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ckpt(lambda t: lin(t).relu(), x)
        ref = lin(x).relu()
    assert out.dtype == torch.bfloat16
    assert_equal(grads(out.float(), [x, lin.weight]), grads(ref.float(), [x, lin.weight]))


def _sac(ops: list[Any]) -> Callable[[], Any]:
    return functools.partial(tc.create_selective_checkpoint_contexts, ops)


@behaviour
def sac_context_fn_keeps_matmuls(ckpt):
    x, w = leaf(3, 4), leaf(4, 4, seed=1)
    out = ckpt(body, x, w, context_fn=_sac([aten.mm.default]))
    ops = count_ops(lambda: out.sum().backward())
    # backward's own two matmuls only: the forward's mm is not redone
    assert ops["aten.mm.default"] == 2
    ref_x = x.grad.clone()
    x.grad = None
    body(x, w).sum().backward()
    assert torch.equal(x.grad, ref_x)


@behaviour
def sac_caching_mode_is_innermost(ckpt):
    seen = []

    def fn(x):
        seen.append(type(_get_current_dispatch_mode()).__name__)
        return x.sin().exp()

    out = ckpt(fn, leaf(3), context_fn=_sac([aten.sin.default]))
    out.sum().backward()
    assert seen == ["_CachingTorchDispatchMode", "_CachedTorchDispatchMode"]


# ------------------------------------------------------------------ GraphExecGroup


def _two_outputs() -> tuple[Callable[..., Any], list[int]]:
    calls = []

    def fn(a, b):
        calls.append(1)
        return a.sin() * b.cos(), b.exp().tanh()

    return fn, calls


@behaviour
def graph_exec_group_recomputes_once(ckpt):
    if not hasattr(tc, "GraphExecGroup"):
        pytest.skip("this torch has no GraphExecGroup")
    fn, calls = _two_outputs()
    a, b = leaf(3), leaf(3, seed=1)
    o1, o2 = ckpt(fn, a, b)
    with tc.GraphExecGroup():
        (ga,) = torch.autograd.grad(o1.sum(), a, retain_graph=True)
        (gb,) = torch.autograd.grad(o2.sum(), b, retain_graph=True)
    assert len(calls) == 2
    p1, p2 = fn(a, b)
    assert torch.equal(ga, grads(p1, [a])[0]) and torch.equal(gb, grads(p2, [b])[0])


@behaviour
def graph_exec_group_refuses_overlap(ckpt):
    if not hasattr(tc, "GraphExecGroup"):
        pytest.skip("this torch has no GraphExecGroup")
    fn, _ = _two_outputs()
    a, b = leaf(3), leaf(3, seed=1)
    o1, _ = ckpt(fn, a, b)
    with tc.GraphExecGroup(), pytest.raises(tc.CheckpointError, match="overlap"):
        torch.autograd.grad(o1.sum(), a, retain_graph=True)
        torch.autograd.grad(o1.sum(), a, retain_graph=True)


# ------------------------------------------------------------------ beyond torch


@behaviour
def nested_double_backward_in_a_graph_exec_group(ckpt):
    if not hasattr(tc, "GraphExecGroup"):
        pytest.skip("this torch has no GraphExecGroup")
    x = leaf(4)
    out = ckpt(_grad_of(_grad_of(lambda t: ckpt(_cube, t))), x)
    with tc.GraphExecGroup():
        (g,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(g, grads(_grad_of(_grad_of(_cube))(x), [x])[0])


@behaviour
def batchnorm_stats_once(ckpt):
    bn = nn.BatchNorm1d(4).double()
    x = leaf(8, 4)
    ckpt(bn, x).sum().backward()
    assert int(bn.num_batches_tracked) == 1


@behaviour
def python_random_replayed(ckpt):
    def fn(x):
        return x * random.random() * x

    x = leaf(3)
    random.seed(0)
    (g,) = grads(ckpt(fn, x), [x])
    random.seed(0)
    (ref,) = grads(fn(x), [x])
    assert torch.equal(g, ref)


@behaviour
def numpy_random_replayed(ckpt):
    np = pytest.importorskip("numpy")

    def fn(x):
        return x * float(np.random.rand()) * x

    x = leaf(3)
    np.random.seed(0)
    (g,) = grads(ckpt(fn, x), [x])
    np.random.seed(0)
    (ref,) = grads(fn(x), [x])
    assert torch.equal(g, ref)


# ------------------------------------------------------------------ torch's way (DELIBERATE)


@behaviour
def omitted_use_reentrant_warns(ckpt):
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
        ckpt(torch.sin, leaf(3), use_reentrant=None)


@behaviour
def global_toggle_beats_the_keyword(ckpt):
    fn, calls = _tail_counter()
    with tc.set_checkpoint_early_stop(False):
        out = ckpt(fn, leaf(3), early_stop=True)
    out.sum().backward()
    assert len(calls) == 2


@behaviour
def debug_with_context_fn_is_refused(ckpt):
    with pytest.raises(ValueError, match="debug=True is incompatible with non-default context_fn"):
        ckpt(torch.sin, leaf(3), debug=True, context_fn=_sac([aten.sin.default]))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name", list(BEHAVIOURS))
def test_behaviour(name: str, impl: str, request: pytest.FixtureRequest) -> None:
    if impl == "torch" and name in BEYOND_TORCH:
        mark = pytest.mark.xfail(strict=True, reason="torch's checkpoint does not do this")
        request.applymarker(mark)
    if impl == "gradckpt" and name in DELIBERATE:
        request.applymarker(pytest.mark.xfail(strict=True, reason=DELIBERATE[name]))
    BEHAVIOURS[name](IMPLS[impl])


def test_there_are_enough_behaviours() -> None:
    assert len(BEHAVIOURS) >= 30
    assert set(BEHAVIOURS) >= BEYOND_TORCH | set(DELIBERATE)
    assert not BEYOND_TORCH & set(DELIBERATE)
