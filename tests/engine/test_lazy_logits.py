"""Lazy logits: a loss written for plain logits runs chunked, and any other read is right.

Each pattern is run twice from the same inputs, once on the head's real logits
and once on :func:`lazy_logits`; the loss and the gradients must agree within
fp32's 1e-5 relative (per tensor), and only the named reads compute the whole.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradckpt.engine.chunking.lazy import LazyLogits, lazy_logits

B, T, H, V = 2, 9, 8, 30


@pytest.fixture
def parts():
    torch.manual_seed(0)
    hidden = torch.randn(B, T, H, requires_grad=True)
    head = nn.Linear(H, V, bias=False)
    labels = torch.randint(0, V, (B, T))
    labels[0, :4] = -100
    return hidden, head, labels


def _both(parts, loss, chunks: int = 4):
    hidden, head, _ = parts
    results = []
    for lazy in (False, True):
        logits = lazy_logits(head, hidden, chunks) if lazy else head(hidden)
        assert isinstance(logits, LazyLogits) == lazy
        out = loss(logits)
        results.append((out.detach(), *torch.autograd.grad(out, [hidden, head.weight])))
    for ref, got in zip(*results):
        assert (got - ref).norm() <= 1e-5 * ref.norm(), (got, ref)


def _hf_causal_lm_loss(labels):
    """transformers' ForCausalLMLoss: upcast, pad-and-shift the labels, flatten, sum / count."""

    def loss(logits):
        logits = logits.float()
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        total = F.cross_entropy(logits.view(-1, V), shifted.view(-1), reduction="sum")
        return total / (shifted != -100).sum()

    return loss


def test_flattened_cross_entropy_runs_chunked_and_equals_the_whole(parts):
    labels = parts[2]
    _both(parts, lambda lg: F.cross_entropy(lg.view(-1, lg.shape[-1]), labels.view(-1)))


def test_a_hugging_face_causal_lm_loss_runs_chunked_unchanged(parts):
    _both(parts, _hf_causal_lm_loss(parts[2]))


def test_shifted_logits_and_label_smoothing(parts):
    labels = parts[2]

    def loss(lg):
        shifted = lg[:, :-1, :].contiguous().view(-1, V)
        return F.cross_entropy(shifted, labels[:, 1:].reshape(-1), label_smoothing=0.1)

    _both(parts, loss)


def test_flattened_halves_as_a_contrastive_step_reads_them(parts):
    labels = parts[2]

    def loss(lg):
        halves = (lg[:1].flatten(0, 1), lg.narrow(0, 1, 1).flatten(0, 1))
        return sum(F.cross_entropy(h, y.flatten()) for h, y in zip(halves, labels.split(1)))

    _both(parts, loss)


def test_log_softmax_then_nll_loss_is_cross_entropy(parts):
    labels = parts[2]
    _both(
        parts, lambda lg: F.nll_loss(F.log_softmax(lg.float(), dim=-1).view(-1, V), labels.view(-1))
    )


def test_lazy_forms_never_compute_the_logits(parts, monkeypatch):
    hidden, head, labels = parts
    logits = lazy_logits(head, hidden, 3)
    calls = []
    monkeypatch.setattr(LazyLogits, "whole", lambda self: calls.append(self))
    derived = logits.float().view(-1, V)[3:].contiguous()
    assert isinstance(derived, LazyLogits) and derived.shape == (B * T - 3, V)
    for view in (logits.flatten(0, 1), torch.flatten(logits, 0, 1), logits.narrow(1, 2, 4),
                 logits[:, 1], logits.unsqueeze(0).squeeze(0)):  # fmt: skip
        assert isinstance(view, LazyLogits), view
    assert logits.flatten(0, 1).shape == (B * T, V) and logits.narrow(1, 2, 4).shape == (B, 4, V)
    assert logits.shape == (B, T, V) and logits.dtype == torch.float32 and logits.requires_grad
    assert "chunks=3" in repr(logits)
    F.cross_entropy(logits.view(-1, V), labels.view(-1))
    assert calls == []


def test_a_loss_that_reads_the_logits_after_the_loss_gets_them_whole_and_right(parts):
    """z-loss written by hand (logsumexp of the logits) and an accuracy: computed
    whole, with a warning that the plan's peak does not hold; values and gradients right."""
    labels = parts[2]

    def loss(lg):
        ce = F.cross_entropy(lg.view(-1, V), labels.view(-1))
        accuracy = (lg.argmax(-1) == labels).float().mean()
        return ce + 1e-3 * torch.logsumexp(lg, -1).pow(2).mean() + 0 * accuracy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _both(parts, loss)
    messages = [str(w.message) for w in caught]
    assert any("computed whole" in m and "chunking=False" in m for m in messages), messages


def test_reads_the_rules_do_not_cover_compute_the_whole(parts):
    hidden, head, labels = parts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = lazy_logits(head, hidden, 2)
        weighted = F.cross_entropy(logits.view(-1, V), labels.view(-1), weight=torch.ones(V))
        last = logits[..., :5]  # indexes the vocabulary: not lazy
    ref = head(hidden)
    assert not isinstance(last, LazyLogits)
    torch.testing.assert_close(last, ref[..., :5])
    torch.testing.assert_close(weighted, F.cross_entropy(ref.view(-1, V), labels.view(-1)))


def test_writing_to_the_logits_in_place_raises_and_names_the_way_out(parts):
    hidden, head, _ = parts
    logits = lazy_logits(head, hidden, 2)
    with pytest.raises(RuntimeError, match=r"div_ writes in place.*logits = logits / t"):
        logits.div_(2.0)
    with pytest.raises(RuntimeError, match="__setitem__ writes in place"):
        logits[0] = 0.0


def test_autocast_state_of_the_head_call_is_kept_for_its_slices(parts):
    hidden, head, labels = parts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = lazy_logits(head, hidden, 3)
        ref = head(hidden)
    assert logits.dtype == torch.bfloat16 == ref.dtype
    loss = F.cross_entropy(logits.float().view(-1, V), labels.view(-1))  # outside autocast
    torch.testing.assert_close(loss, F.cross_entropy(ref.float().view(-1, V), labels.view(-1)))
