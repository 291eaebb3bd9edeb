"""gradckpt.tune: candidates in whole-step bytes, checked by running, never over the budget."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.testing import make
from gradckpt.testing.gpts import _next_token_loss
from gradckpt.tuning import TuneResult, sliced_loss, tune
from gradckpt.tuning.timing import BatchTimes


def _gpt(batch: int = 8):
    ex = make("gpt", layers=3, d_model=64, seq=64, vocab=256, batch=batch)
    model = ex.model

    def make_loss(b: int):
        rows = {k: v[:b] for k, v in ex.inputs.items()}
        return lambda: _next_token_loss(model, rows)

    return model, make_loss


def test_tune_stays_within_the_budget_and_keeps_a_measured_candidate(one_thread):
    model, make_loss = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    whole = gradckpt.profile(model, make_loss(8), optimizer=opt, fake=True)
    budget = int(0.5 * whole.measured_peak_bytes)  # the plain micro-batch of 8 does not fit
    with AllocatorTracker() as at:
        result = tune(model, make_loss, budget, optimizer=opt, global_batch=8)
    assert state_bytes(model) + at.peak_bytes <= budget  # planning and measuring included
    assert isinstance(result, TuneResult)
    assert result.micro_batch * result.accumulation_steps == 8
    chosen = [c for c in result.candidates if c.verdict == "chosen"]
    assert len(chosen) == 1 and chosen[0].measured_samples_per_s > 0
    assert chosen[0].measured_peak_bytes <= budget
    assert result.plan.predicted_peak_bytes <= budget and result.plan.step is not None
    # Every size under every strategy was predicted; the plain 8 is over the budget.
    assert {(c.micro_batch, c.strategy) for c in result.candidates} == {
        (b, s) for b in (1, 2, 4, 8) for s in ("none", "per-layer", "gradckpt")
    }
    plain_8 = next(c for c in result.candidates if (c.micro_batch, c.strategy) == (8, "none"))
    assert plain_8.plan is None and plain_8.verdict.startswith("over budget")
    assert "chosen" in result.table() and result.to_json()["micro_batch"] == result.micro_batch
    assert gradckpt.applied_plan(model) is None  # the model is left plain
    result.apply(model)
    assert gradckpt.applied_plan(model) is result.plan
    gradckpt.remove(model)


def test_tune_leaves_the_model_as_found(one_thread):
    model, make_loss = _gpt(4)
    torch.manual_seed(3)
    make_loss(4)().backward()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    rng = torch.get_rng_state()
    tune(model, make_loss, "1GiB", optimizer="adamw", global_batch=4, rounds=1)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, grads[k]) for k, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_budget_nothing_fits_is_a_budget_error(one_thread):
    model, make_loss = _gpt(4)
    with pytest.raises(BudgetError):
        tune(model, make_loss, state_bytes(model) + 1024, global_batch=4)


def test_bad_arguments_are_refused_before_anything_runs():
    model, make_loss = _gpt(4)
    with pytest.raises(ValueError, match="fraction"):
        tune(model, make_loss, 0.5, global_batch=4)
    with pytest.raises(ValueError, match="do not divide"):
        tune(model, make_loss, "1GiB", global_batch=4, batch_sizes=[3])
    with pytest.raises(ValueError, match="global_batch"):
        tune(model, make_loss, "1GiB", global_batch=0)


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"global_batch": 10**12}, ["global_batch", "1048576"]),  # ran without end before #40
        ({"global_batch": 1_000_003}, ["1000003", "no divisor", "1000002", "1000004"]),
        ({"global_batch": 8.0}, ["global_batch", "whole number"]),
        ({"global_batch": 8, "batch_sizes": [8192]}, ["batch_sizes", "4096"]),
        ({"global_batch": 8, "top": 0}, ["top", ">= 1", "0"]),
        ({"global_batch": 8, "rounds": 0}, ["rounds", ">= 1", "0"]),
        ({"global_batch": 8, "rounds": 1.5}, ["rounds", "whole number"]),
    ],
)
def test_out_of_bounds_inputs_are_one_line_errors_before_any_work(kwargs, fragments):
    model, _ = _gpt(4)

    def make_loss(b: int):
        raise AssertionError("tune made a loss: it started working")

    with pytest.raises(ValueError) as caught:
        tune(model, make_loss, "1GiB", **kwargs)
    text = str(caught.value)
    assert "\n" not in text and all(f in text for f in fragments), text


def test_a_prime_global_batch_with_a_micro_batch_besides_one_is_tuned_as_before():
    from gradckpt.tuning.sizes import candidate_sizes

    assert candidate_sizes(13, None) == [1, 13]  # one sample at a time, or all at once
    assert candidate_sizes(4099 * 2, None) == [1, 2]  # divisors above 4096 are not tried
    assert candidate_sizes(1_000_003, [1]) == [1]  # asked for by name


def test_sliced_loss_takes_and_repeats_rows():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x, y=None):
            seen.append((x.shape[0], None if y is None else y.shape[0]))
            return x.float().sum()

    batch = {"x": torch.arange(6).view(3, 2), "y": torch.zeros(3)}
    make_loss = sliced_loss(Probe(), batch)
    make_loss(2)()
    make_loss(5)()
    assert seen == [(2, 2), (5, 5)]
    assert sliced_loss(Probe(), (torch.ones(4, 2),))(3)() == 6
    with pytest.raises(TypeError, match="sliced_loss"):
        sliced_loss(Probe(), torch.ones(2))


def test_step_time_is_linear_in_the_batch_from_two_real_sizes():
    model, make_loss = _gpt(4)
    real = {b: gradckpt.profile(model, make_loss(b), repeats=1) for b in (1, 2)}
    fake = {b: gradckpt.profile(model, make_loss(b), fake=True) for b in (1, 2, 4)}
    times = BatchTimes.fit(real, {b: fake[b] for b in (1, 2)})
    t1, t2 = real[1].step_time, real[2].step_time
    at4 = times.at(fake[4], 4)
    assert at4.step_time == pytest.approx(t1 + max(0.0, t2 - t1) * 3)
    assert sum(op.time for op in at4.ops) == pytest.approx(at4.step_time)
    assert "linear" in times.method
    one = BatchTimes.fit({1: real[1]}, {1: fake[1]})
    assert one.at(fake[4], 4).step_time == pytest.approx(4 * t1)
    assert BatchTimes.fit({}, {}).at(fake[4], 4) is fake[4]
