"""PEFT LoRA (``get_peft_model``) under gradckpt: exact adapter gradients, frozen base, budget held.

The base is frozen, so nothing entering a decoder layer requires grad: the case
torch's reentrant checkpoint gets wrong. Both ways in are checked against the
plain run with the same seed (model and LoRA dropout on): ``gradckpt.fit`` and
the Trainer's ``BudgetCallback``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainingArguments

import gradckpt
from gradckpt.integrations.hf import BudgetCallback
from gradckpt.integrations.hf.zoo import run_step
from gradckpt.integrations.peft_zoo import adapter_names, lora_example
from gradckpt.planning.plans.plan import iter_units

BUDGET = 0.8


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fit_gives_adapters_their_exact_gradients_within_budget(name):
    ex = lora_example(name, layers=3)
    adapters = adapter_names(ex.model)
    assert adapters and all("lora_" in n for n in adapters)
    plain = run_step(ex)
    assert sorted(plain.grads) == sorted(adapters)  # the base is frozen
    assert all(g.abs().sum() > 0 for g in plain.grads.values())  # lora_A and lora_B both learn

    plan = gradckpt.fit(ex.model, ex.loss_fn, BUDGET, profiling=gradckpt.ProfileOptions(repeats=1))
    # The decoder layers under PEFT's wrappers are the blocks, and some are checkpointed
    # (on their own, or inside a multi-layer segment).
    assert len(ex.block_paths) == 3
    assert {u.path for u in plan.units} >= set(ex.block_paths)
    in_segments = {
        u.path for i in plan.items if isinstance(i, gradckpt.Segment) for u in iter_units(i.items)
    }
    checkpointed = {u.path for u in plan.units if u.mode != "keep"} | in_segments
    assert checkpointed & set(ex.block_paths)
    planned = run_step(ex)
    assert planned.grads.keys() == plain.grads.keys()
    for k, g in plain.grads.items():
        assert torch.equal(planned.grads[k], g), k
    assert torch.equal(planned.loss, plain.loss)
    assert planned.peak_bytes <= plan.budget_bytes < plain.peak_bytes
    # The simulator predicts the measured peak (within 2%; plans vary with op timings).
    assert abs(planned.peak_bytes - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(1, 128, (8, 32), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train_lora(tmp_path, callbacks=()):
    model = lora_example("llama", layers=3).model
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=list(callbacks))
    trainer.train()
    return model, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_callback_on_a_peft_model(tmp_path):
    plain_model, plain_losses = _train_lora(tmp_path / "plain")
    callback = BudgetCallback(BUDGET, repeats=1)
    model, losses = _train_lora(tmp_path / "planned", [callback])
    assert gradckpt.applied_plan(model) is callback.plan
    assert len(losses) == 3 and losses == plain_losses
    trained = dict(model.named_parameters())
    for name, p in plain_model.named_parameters():
        assert torch.equal(trained[name], p), name
    assert callback.report.measured_peak_bytes <= callback.report.budget_bytes
