"""torch's global checkpoint toggles, error type and words, and SAC's mode order.

``torch.utils.checkpoint.set_checkpoint_early_stop`` and
``set_checkpoint_debug_enabled`` are honoured when gradckpt's checkpoint runs;
an explicit keyword (``early_stop=``, ``debug=``) wins over them, which is the
preferred form (one deliberate difference: in torch the global toggle wins).
gradckpt's ``CheckpointError`` is a subclass of torch's and its messages
contain torch's words, so code written against torch's errors keeps working.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as tc
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gradckpt


def tail_counter():
    calls = []

    def fn(x):
        y = x.sin()  # last op that saves: the recompute can stop here
        calls.append(1)
        return y * 2.0

    return fn, calls


@pytest.mark.parametrize(
    ("toggle", "keyword", "tail_reruns"),
    [
        (None, None, False),
        (False, None, True),
        (True, None, False),
        (False, True, False),  # the keyword wins
        (True, False, True),
    ],
)
def test_early_stop_toggle_and_keyword(toggle, keyword, tail_reruns):
    fn, calls = tail_counter()
    x = torch.randn(3, requires_grad=True)
    options = {} if keyword is None else {"early_stop": keyword}
    if toggle is None:
        out = gradckpt.checkpoint(fn, x, **options)
    else:
        with tc.set_checkpoint_early_stop(toggle):
            out = gradckpt.checkpoint(fn, x, **options)
    out.sum().backward()  # the toggle is read when the region opens, not in backward
    assert len(calls) == (2 if tail_reruns else 1)


def shape_changing():
    calls = []

    def fn(x):
        calls.append(1)
        return (x if len(calls) == 1 else x[:2]).sin().sum() * x

    return fn


@pytest.mark.parametrize(
    ("toggle", "keyword", "logs"),
    [(None, None, False), (True, None, True), (True, False, False), (False, True, True)],
)
def test_debug_toggle_and_keyword(toggle, keyword, logs):
    x = torch.randn(3, requires_grad=True)
    options = {} if keyword is None else {"debug": keyword}
    if toggle is None:
        out = gradckpt.checkpoint(shape_changing(), x, **options)
    else:
        with tc.set_checkpoint_debug_enabled(toggle):
            out = gradckpt.checkpoint(shape_changing(), x, **options)
    with pytest.raises(gradckpt.CheckpointError) as info:
        out.sum().backward()
    assert ("Ops in the recompute" in str(info.value)) == logs
    assert ("Detected non-determinism while running activation" in str(info.value)) == logs


def test_toggles_are_read_by_every_region_not_only_checkpoint():
    # A Frame opened by gradckpt.apply's wrappers reads the same toggle.
    from gradckpt.engine import Frame

    with tc.set_checkpoint_early_stop(False):
        assert Frame(None).early_stop is False
    assert Frame(None).early_stop is True
    assert Frame(None, early_stop=False).early_stop is False


def test_checkpoint_error_is_torchs():
    assert issubclass(gradckpt.CheckpointError, tc.CheckpointError)
    assert issubclass(gradckpt.CheckpointError, RuntimeError)


def test_metadata_mismatch_has_torch_words_and_ours():
    out = gradckpt.checkpoint(shape_changing(), torch.randn(3, requires_grad=True))
    with pytest.raises(tc.CheckpointError) as info:
        out.sum().backward()
    text = str(info.value)
    assert "Recomputed values for the following tensors have different metadata" in text
    assert "torch.Size([2])" in text and "torch.Size([3])" in text and "debug=True" in text


def test_count_mismatch_has_torch_words_and_ours():
    calls = []

    def fn(x):
        calls.append(1)
        y = x.sin()
        return y.exp() if len(calls) == 1 else y * 2.0

    out = gradckpt.checkpoint(fn, torch.randn(3, requires_grad=True), early_stop=False)
    with pytest.raises(tc.CheckpointError) as info:
        out.sum().backward()
    text = str(info.value)
    assert "A different number of tensors was saved during the original forward" in text
    assert "saved 1 tensors during its recompute but 2 during its forward" in text


def test_more_tensors_in_recompute_has_torch_words():
    calls = []

    def fn(x):
        calls.append(1)
        y = x.sin()
        return y if len(calls) == 1 else y.exp().exp()

    out = gradckpt.checkpoint(fn, torch.randn(3, requires_grad=True), early_stop=False)
    with pytest.raises(
        tc.CheckpointError, match="trying to save more tensors during recomputation"
    ):
        out.sum().backward()


def test_double_unpack_has_torch_words_and_ours():
    class ReadTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            first = ctx.saved_tensors
            return grad * ctx.saved_tensors[0] + 0 * first[0]

    out = gradckpt.checkpoint(
        lambda t: ReadTwice.apply(t.sin()), torch.randn(3, requires_grad=True)
    )
    with pytest.raises(tc.CheckpointError) as info:
        out.sum().backward()
    text = str(info.value)
    assert "Unpack is being triggered for a tensor that was already unpacked once" in text
    assert "read it once per backward" in text


def _record_mode_stack(seen):
    def fn(x):
        seen.append(type(_get_current_dispatch_mode()).__name__)
        return x.sin().exp().cos()

    return fn


@pytest.mark.parametrize("policy", [None, gradckpt.policies.save_matmuls], ids=["plain", "policy"])
def test_sac_modes_are_innermost_in_forward_and_recompute(policy):
    seen = []
    context_fn = functools.partial(
        tc.create_selective_checkpoint_contexts, [torch.ops.aten.sin.default]
    )
    x = torch.randn(3, requires_grad=True)
    out = gradckpt.checkpoint(_record_mode_stack(seen), x, context_fn=context_fn, policy=policy)
    out.sum().backward()
    assert seen == ["_CachingTorchDispatchMode", "_CachedTorchDispatchMode"]
    ref = x.grad.clone()
    x.grad = None
    x.sin().exp().cos().sum().backward()
    assert torch.equal(x.grad, ref)
