"""``tune_training_args``: the Trainer's micro-batch, accumulation and plan for a budget.

A tiny GPT-2 with AdamW, a global batch of 8 and a budget the plain micro-batch
of 8 does not fit: the tuned arguments keep the global batch, and two training
steps with them and the returned callback stay within the budget at the allocator.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainingArguments

import gradckpt
from gradckpt.integrations import hf
from gradckpt.integrations.hf import BudgetCallback, tune_training_args
from gradckpt.integrations.hf.zoo import hf_example
from gradckpt.measure import AllocatorTracker, state_bytes

from .conftest import TokenData

VOCAB, SEQ = 128, 32


class IndexedTokens(TokenData):
    """Token sequences (labels = inputs) and an index the model does not take."""

    def __getitem__(self, i: int) -> dict:
        # "idx" is no argument of GPT-2's forward: the Trainer drops it, so must the tuner.
        return {**super().__getitem__(i), "idx": i}


def _args(tmp_path, **options) -> TrainingArguments:
    settings = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        learning_rate=3e-4, warmup_steps=1,
    )  # fmt: skip
    settings.update(options)
    return TrainingArguments(**settings)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One tuning for the module: (model, args, budget, (tuned args, callback, result))."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = hf_example("gpt2", layers=3).model
        ids = IndexedTokens(vocab=VOCAB, seq=SEQ).ids[:8]
        with warnings.catch_warnings():  # "planned with use_cache=False": the callback sees to it
            warnings.simplefilter("ignore")
            plain = gradckpt.profile(
                model, lambda: model(input_ids=ids, labels=ids).loss, optimizer="adamw", fake=True
            )
        budget = int(0.8 * plain.measured_peak_bytes)  # the plain micro-batch of 8 does not fit
        args = _args(tmp_path_factory.mktemp("tune"))
        yield model, args, budget, tune_training_args(model, args, IndexedTokens(vocab=VOCAB, seq=SEQ), budget=budget)
    finally:
        torch.set_num_threads(threads)


def test_the_global_batch_is_kept_and_every_other_argument(tuned):
    model, args, budget, (new_args, callback, result) = tuned
    assert new_args is not args and args.per_device_train_batch_size == 8  # not changed
    assert new_args.per_device_train_batch_size == result.micro_batch
    assert new_args.gradient_accumulation_steps == result.accumulation_steps
    assert result.micro_batch * result.accumulation_steps == 8
    before, after = args.to_dict(), new_args.to_dict()
    changed = {k for k in before if before[k] != after[k]}
    assert changed <= {"per_device_train_batch_size", "gradient_accumulation_steps"}
    # Divisors of 8 under the three strategies; the plain 8 is over the budget.
    assert {c.micro_batch for c in result.candidates} == {1, 2, 4, 8}
    plain_8 = next(c for c in result.candidates if (c.micro_batch, c.strategy) == (8, "none"))
    assert plain_8.plan is None and plain_8.verdict.startswith("over budget")
    assert result.budget_bytes == budget and result.plan.predicted_peak_bytes <= budget
    chosen = next(c for c in result.candidates if c.verdict == "chosen")
    assert chosen.measured_peak_bytes <= budget
    assert isinstance(callback, BudgetCallback) and callback.ready_plan is result.plan
    assert callback.budget == budget
    assert gradckpt.applied_plan(model) is None  # nothing applied before training


def test_training_with_the_tuned_args_stays_within_the_budget(tuned, tmp_path, one_thread):
    model, _, budget, (new_args, callback, result) = tuned
    trainer = Trainer(model=model, args=new_args, train_dataset=IndexedTokens(vocab=VOCAB, seq=SEQ), callbacks=[callback])
    held = state_bytes(model)
    with AllocatorTracker() as at:
        trainer.train()
    assert trainer.state.global_step == 2
    assert held + at.peak_bytes <= budget  # the whole of training, optimizer included
    assert gradckpt.applied_plan(model) is result.plan is callback.plan
    assert not model.config.use_cache  # applied with the model's training switches
    report = callback.report
    assert report.budget_bytes == budget and report.measured_steps == 2
    assert report.within_budget
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # finite
    gradckpt.remove(model)


def test_a_ready_plan_for_other_accumulation_warns(tuned, tmp_path, one_thread):
    _, _, budget, (_, _, result) = tuned
    model = hf_example("gpt2", layers=3).model  # the same structure: the plan applies
    other = result.accumulation_steps + 1
    args = _args(tmp_path, max_steps=1, per_device_train_batch_size=result.micro_batch,
                 gradient_accumulation_steps=other)  # fmt: skip
    callback = BudgetCallback(budget, plan=result.plan)
    trainer = Trainer(model=model, args=args, train_dataset=IndexedTokens(vocab=VOCAB, seq=SEQ), callbacks=[callback])
    with pytest.warns(UserWarning, match=f"made for {result.accumulation_steps} micro-batches"):
        trainer.train()
    assert gradckpt.applied_plan(model) is result.plan


def test_arguments_are_checked(tuned):
    model, args, _, (_, _, result) = tuned
    with pytest.raises(TypeError, match=r"gradckpt\.Plan"):
        BudgetCallback("1GiB", plan=result.plan.to_json())
    with pytest.raises(TypeError, match="TrainingArguments"):
        tune_training_args(model, dataclasses.asdict(args), IndexedTokens(vocab=VOCAB, seq=SEQ))
    with pytest.raises(ValueError, match="empty"):
        tune_training_args(model, args, [], budget="1GiB")
    assert hf.tune_training_args is tune_training_args  # the lazy export
