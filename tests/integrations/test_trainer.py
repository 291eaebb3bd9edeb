"""The Hugging Face Trainer with ``gradckpt.integrations.hf.BudgetCallback``.

Every test compares against a plain Trainer run with the same seed (dropout on):
the losses and the trained weights must be identical, since planning leaves the
model as it found it and checkpointing with RNG replay recomputes the same values.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import gradckpt
from gradckpt.integrations.hf import BudgetCallback
from gradckpt.integrations.hf.zoo import hf_example

from .conftest import TokenData

# transformers 5.x renamed TrainingArguments.gradient_checkpointing (the old name warns).
_OWN_SWITCH = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)
BUDGET = 0.85  # of the plain peak; the tiny GPT-2 cannot go much lower
VOCAB, SEQ = 128, 32


pytestmark = pytest.mark.usefixtures("one_thread")


def _train(tmp_path, callbacks=(), *, model=None, resume=None, **options):
    model = model if model is not None else hf_example("gpt2", layers=3).model
    settings = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    settings.update(options)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**settings),
        train_dataset=TokenData(),
        eval_dataset=TokenData(4, seed=5),
        callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        assert torch.equal(p, pb[name]), name


@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_accumulation_steps": 2}, {"bf16": True}],
    ids=["plain", "grad-accum-2", "bf16"],
)
def test_losses_and_weights_identical_to_a_plain_trainer(tmp_path, options, caplog):
    plain, plain_losses = _train(tmp_path / "plain", **options)
    callback = BudgetCallback(BUDGET, repeats=1)
    with caplog.at_level(logging.INFO, logger="gradckpt"):
        planned, losses = _train(tmp_path / "planned", [callback], **options)
    assert len(losses) == 3
    assert losses == plain_losses
    _assert_same_weights(planned.model, plain.model)
    # The plan is applied, recomputes something, and its measured peak holds the budget.
    assert gradckpt.applied_plan(planned.model) is callback.plan
    assert any(unit.mode != "keep" for unit in callback.plan.units) or any(
        isinstance(item, gradckpt.Segment) for item in callback.plan.items
    )
    report = callback.report
    assert report.measured_peak_bytes <= report.budget_bytes < report.baseline_peak_bytes
    # The simulator predicts the measured peak (within 2%; plans vary with op timings).
    assert (
        abs(report.measured_peak_bytes - report.predicted_peak_bytes)
        <= 0.02 * report.predicted_peak_bytes
    )
    assert report.line() in caplog.text and "gradckpt plan" in caplog.text
    logged = [h for h in planned.state.log_history if "gradckpt_measured_peak_bytes" in h]
    assert len(logged) == 1 and logged[0]["gradckpt_budget_bytes"] == report.budget_bytes


def test_replaces_the_trainers_own_gradient_checkpointing(tmp_path):
    _, plain_losses = _train(tmp_path / "plain")
    callback = BudgetCallback(BUDGET, repeats=1)
    with pytest.warns(UserWarning, match="turned transformers' own activation checkpointing off"):
        planned, losses = _train(tmp_path / "both", [callback], **{_OWN_SWITCH: True})
    assert losses == plain_losses
    assert not any(getattr(m, "gradient_checkpointing", False) for m in planned.model.modules())
    assert gradckpt.applied_plan(planned.model) is callback.plan


def test_bf16_is_planned_under_the_trainers_autocast(tmp_path):
    fp32, bf16 = BudgetCallback(BUDGET, repeats=1), BudgetCallback(BUDGET, repeats=1)
    _train(tmp_path / "fp32", [fp32], max_steps=1)
    _train(tmp_path / "bf16", [bf16], max_steps=1, bf16=True)
    # bf16 activations are half the size: the planned plain step is smaller.
    assert bf16.report.baseline_peak_bytes < fp32.report.baseline_peak_bytes


def test_checkpoints_load_into_a_plain_model_and_resume_identically(tmp_path):
    full, full_losses = _train(
        tmp_path, [BudgetCallback(BUDGET, repeats=1)], max_steps=4, save_strategy="steps",
        save_steps=2,
    )  # fmt: skip
    last = tmp_path / "checkpoint-4"
    plain_model, info = GPT2LMHeadModel.from_pretrained(last, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    _assert_same_weights(plain_model, full.model)

    resumed, resumed_losses = _train(
        tmp_path, [BudgetCallback(BUDGET, repeats=1)], max_steps=4, save_strategy="steps",
        save_steps=2, resume=str(tmp_path / "checkpoint-2"),
    )  # fmt: skip
    # The resumed history starts with the two losses read back from checkpoint-2.
    assert len(resumed_losses) == 4 and resumed_losses[2:] == full_losses[2:]
    _assert_same_weights(resumed.model, full.model)


class GenerateOnEvaluate(TrainerCallback):
    """Greedy generation at each evaluation; records what the first layer saw per call."""

    def __init__(self) -> None:
        self.sequences: list[torch.Tensor] = []
        self.lengths: list[list[int]] = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        prompt = torch.arange(1, 9).unsqueeze(0)
        seen: list[int] = []
        hook = model.transformer.h[0].register_forward_pre_hook(
            lambda module, inputs: seen.append(inputs[0].shape[1])
        )
        try:
            out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        finally:
            hook.remove()
        self.sequences.append(out)
        self.lengths.append(seen)


class CacheDuringTraining(TrainerCallback):
    def __init__(self) -> None:
        self.training_caches: list[bool] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def record(module, inputs, output):
            if module.training and torch.is_grad_enabled():
                self.training_caches.append(output.past_key_values is not None)

        model.register_forward_hook(record)


def test_generate_during_evaluation_uses_the_kv_cache(tmp_path):
    options = dict(max_steps=4, eval_strategy="steps", eval_steps=2)
    plain_gen = GenerateOnEvaluate()
    _train(tmp_path / "plain", [plain_gen], **options)
    gen, cache = GenerateOnEvaluate(), CacheDuringTraining()
    callback = BudgetCallback(BUDGET, repeats=1)
    trainer, _ = _train(tmp_path / "planned", [callback, gen, cache], **options)
    assert gradckpt.applied_plan(trainer.model) is not None
    assert len(gen.sequences) == 2
    for got, want in zip(gen.sequences, plain_gen.sequences):
        assert torch.equal(got, want)
    # With a KV cache the prompt runs once, then one token per call.
    assert gen.lengths == [[8, 1, 1, 1, 1]] * 2
    # Training ran without one (no second copy of keys and values under recompute).
    assert cache.training_caches and not any(cache.training_caches)


def test_bad_budget_fails_when_the_callback_is_made():
    with pytest.raises(ValueError, match="budget"):
        BudgetCallback("lots")
    with pytest.raises(TypeError, match="loss_from"):
        BudgetCallback(0.5, loss_from="loss")


class _BareLoss(torch.nn.Module):
    """A model whose forward returns its loss as a bare scalar tensor (no dict, no .loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return torch.nn.functional.cross_entropy(x, labels)


class _Vectors(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.randn(16, generator=torch.Generator().manual_seed(i)),
                "labels": torch.tensor(i % 16)}  # fmt: skip


def test_a_model_returning_a_bare_scalar_loss_is_told_how_the_trainer_reads_losses(tmp_path):
    model = _BareLoss()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_Vectors(),
                      callbacks=[BudgetCallback(0.9, loss_from=lambda out: out)])  # fmt: skip
    with pytest.raises(ValueError, match=r"outputs\['loss'\] or outputs\[0\].*compute_loss_func"):
        trainer.train()
    assert gradckpt.applied_plan(model) is None


def test_importing_gradckpt_loads_no_trainer_library():
    code = (
        "import sys, gradckpt, gradckpt.integrations, gradckpt.integrations.hf; "
        "print([m for m in ('transformers', 'accelerate', 'peft', 'diffusers', 'lightning', "
        "'pytorch_lightning') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
