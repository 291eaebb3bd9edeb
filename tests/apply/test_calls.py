"""A module called several times per step runs each call as the unit the plan made of it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradckpt
from gradckpt.engine.decisions import KEEP, RECOMPUTE
from gradckpt.measure import AllocatorTracker, count_flops, state_bytes
from gradckpt.planning import Plan, Segment, UnitChoice, simulate
from gradckpt.testing import ConvBNReLU, ResidualMLPBlock, gpt


class Looped(nn.Module):
    """One block run three times between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.core = ResidualMLPBlock(32, 128, 0.1)  # dropout on: the recompute must replay it
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for _ in range(3):
            x = self.core(x)
        return self.out(x)


def _looped():
    torch.manual_seed(0)
    model, x = Looped().train(), torch.randn(64, 8)
    return model, lambda: model(x).pow(2).mean()


def _step(model: nn.Module, loss_fn, seed: int = 1):
    """(allocator peak with parameters, gradients, FLOPs) of a seeded training step.

    Counted in a second step: torch's FLOP counter holds tensors of its own.
    """
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with AllocatorTracker() as at:
        loss_fn().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.manual_seed(seed)
    flops = count_flops(lambda: loss_fn().backward()).total
    model.zero_grad(set_to_none=True)
    return state_bytes(model) + at.peak_bytes, grads, flops


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _close(a: dict, b: dict, plan: Plan) -> bool:
    """Bit for bit, or within 1e-5 relative per tensor when the plan chunks a head and
    its loss (slice sums in another order)."""
    if not any(u.mode == "chunk" for u in plan.units):
        return _same(a, b)
    return a.keys() == b.keys() and all((a[k] - b[k]).norm() <= 1e-5 * b[k].norm() for k in a)


def _plan(prof, decide) -> Plan:
    return Plan(tuple(UnitChoice(u.path, decide(u)) for u in prof.units if u.plannable),
                prof.fingerprint)  # fmt: skip


def _recompute_flops(prof, paths: set[str]) -> int:
    """FLOPs the simulator says recomputing exactly ``paths`` (alone, each) reruns."""
    plan = _plan(prof, lambda u: RECOMPUTE if u.path in paths else KEEP)
    return simulate(prof, plan).recompute_flops


def test_each_call_runs_its_own_decision_and_the_recompute_is_exactly_those_calls():
    model, loss_fn = _looped()
    _, plain_grads, plain_flops = _step(model, loss_fn)
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    plans = {
        calls: _plan(prof, lambda u, calls=calls: RECOMPUTE if u.path in calls else KEEP)
        for calls in (("core#0", "core#1"), ("core#1", "core#2"))
    }
    predicted = {calls: simulate(prof, plan) for calls, plan in plans.items()}
    # Which calls are recomputed shows in the peak (the same FLOPs either way).
    first, last = (predicted[c].peak_bytes for c in plans)
    assert abs(first - last) > 0.1 * first
    for calls, plan in plans.items():
        gradckpt.apply(model, plan)
        for seed in (1, 1, 2):  # the calls are counted afresh each step
            peak, grads, flops = _step(model, loss_fn, seed)
            if seed == 1:
                assert _same(grads, plain_grads)
            assert abs(peak - predicted[calls].peak_bytes) <= 0.01 * peak
            assert flops - plain_flops == predicted[calls].recompute_flops > 0
            with torch.no_grad():  # an evaluation forward does not count as calls of the step
                model(torch.randn(2, 8))


def test_a_segment_over_two_calls_of_one_module_recomputes_both():
    model, loss_fn = _looped()
    _, plain_grads, plain_flops = _step(model, loss_fn)
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    plan = Plan(
        (UnitChoice("inp"), Segment((UnitChoice("core#0"), UnitChoice("core#1"))),
         UnitChoice("core#2"), UnitChoice("out")),
        prof.fingerprint,
    )  # fmt: skip
    gradckpt.apply(model, plan)
    _, grads, flops = _step(model, loss_fn)
    assert _same(grads, plain_grads)
    assert flops - plain_flops == simulate(prof, plan).recompute_flops


def test_a_forward_cut_short_misplaces_decisions_for_one_step_only():
    model, loss_fn = _looped()
    _, plain_grads, plain_flops = _step(model, loss_fn)
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    gradckpt.apply(model, _plan(prof, lambda u: RECOMPUTE if u.path == "core#0" else KEEP))

    def fail_once(module, args, out):
        handle.remove()
        raise RuntimeError("stopped after the first call")

    handle = model.core.register_forward_hook(fail_once)
    with pytest.raises(RuntimeError, match="stopped"):
        loss_fn()
    # The next step's calls are counted from the second: gradients stay exact, and the
    # recompute lands on the step's third call (the count wraps), which peaks higher.
    expected = {c: simulate(prof, _plan(prof, lambda u, c=c: RECOMPUTE if u.path == c else KEEP))
                for c in ("core#0", "core#2")}  # fmt: skip
    assert expected["core#2"].peak_bytes > 1.1 * expected["core#0"].peak_bytes
    peak, grads, flops = _step(model, loss_fn)
    assert _same(grads, plain_grads)
    assert abs(peak - expected["core#2"].peak_bytes) <= 0.01 * peak
    # Its backward started the count again: the step after runs the plan's calls.
    peak, grads, flops = _step(model, loss_fn)
    assert _same(grads, plain_grads)
    assert abs(peak - expected["core#0"].peak_bytes) <= 0.01 * peak
    assert flops - plain_flops == expected["core#0"].recompute_flops


def test_a_copy_of_the_applied_model_counts_its_own_calls():
    model, loss_fn = _looped()
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    gradckpt.apply(model, _plan(prof, lambda u: RECOMPUTE if u.path == "core#1" else KEEP))
    twin = copy.deepcopy(model)
    x = torch.randn(64, 8)
    _, grads, _ = _step(model, lambda: model(x).pow(2).mean())
    _, twin_grads, _ = _step(twin, lambda: twin(x).pow(2).mean())
    assert _same(grads, twin_grads)
    gradckpt.remove(twin)
    assert "forward" not in twin.core.__dict__


def _siamese():
    """The zoo GPT called twice per step, on two halves of a batch (as contrastive steps do)."""
    ex = gpt(layers=3, d_model=32, heads=4, seq=32, vocab=256, batch=4)
    idx, targets = ex.inputs["idx"], ex.inputs["targets"]

    def loss_fn():
        total = 0.0
        for half in (slice(0, 2), slice(2, 4)):
            logits = ex.model(idx[half])
            total = total + F.cross_entropy(logits.flatten(0, 1), targets[half].flatten())
        return total

    return ex.model, loss_fn


def test_two_model_calls_per_step_plan_as_one_step():
    model, loss_fn = _siamese()
    _, plain_grads, plain_flops = _step(model, loss_fn)
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    blocks = [u.path for u in prof.units if u.is_block]
    assert blocks == [f"blocks.{i}#{k}" for k in (0, 1) for i in range(3)]
    # Per call: the first model call's blocks recomputed, the second's kept.
    first = {f"blocks.{i}#0" for i in range(3)}
    gradckpt.apply(model, _plan(prof, lambda u: RECOMPUTE if u.path in first else KEEP))
    _, grads, flops = _step(model, loss_fn)
    assert _same(grads, plain_grads)
    assert flops - plain_flops == _recompute_flops(prof, first)
    gradckpt.remove(model)
    # fit's plan of the whole step holds its budget at the allocator, gradients exact
    # (up to the order of sums when it chunks the second call's head and its loss).
    plan = gradckpt.fit(model, loss_fn, 0.6, profiling=gradckpt.ProfileOptions(profile=prof))
    peak, grads, _ = _step(model, loss_fn)
    assert _close(grads, plain_grads, plan)
    assert peak <= plan.budget_bytes
    assert abs(peak - plan.predicted_peak_bytes) <= 0.02 * peak


def test_albert_fits_six_tenths_of_plain_and_holds_it():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=128, embedding_size=32, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    model = transformers.AlbertForMaskedLM(config).train()
    ids = torch.randint(0, 128, (8, 32))

    def loss_fn():
        return model(input_ids=ids, labels=ids).loss

    plain, plain_grads, _ = _step(model, loss_fn)
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    shared = [u.path for u in prof.units if u.is_block]
    assert shared == [f"albert.encoder.albert_layer_groups.0#{k}" for k in range(4)]
    plan = gradckpt.fit(model, loss_fn, 0.6, profiling=gradckpt.ProfileOptions(profile=prof))
    for _ in range(2):
        peak, grads, _ = _step(model, loss_fn)
        assert _same(grads, plain_grads)
        assert peak <= plan.budget_bytes <= 0.6 * plain * 1.01
        assert abs(peak - plan.predicted_peak_bytes) <= 0.02 * peak


class LoopedBN(nn.Module):
    """A conv-BatchNorm block run three times: its running statistics move once per call."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.core = ConvBNReLU(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for _ in range(3):
            x = self.core(x)
        return self.head(x.mean((2, 3)))


def test_each_call_updates_running_statistics_once_as_in_a_plain_step():
    torch.manual_seed(0)
    model, x = LoopedBN().train(), torch.randn(4, 3, 16, 16)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    prof = gradckpt.profile(model, loss_fn, repeats=1)  # leaves the buffers as found
    plain = copy.deepcopy(model)
    _, plain_grads, _ = _step(plain, lambda: plain(x).pow(2).mean())
    gradckpt.apply(model, _plan(prof, lambda u: RECOMPUTE if u.path != "core#2" else KEEP))
    _, grads, _ = _step(model, loss_fn)
    assert _same(grads, plain_grads)
    # _step ran two steps on each model (one measured, one counted): three calls each.
    for name, value in plain.core.bn.named_buffers():
        assert torch.equal(getattr(model.core.bn, name), value), name
    assert int(model.core.bn.num_batches_tracked) == 6
