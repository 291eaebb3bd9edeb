"""Lightning with ``gradckpt.integrations.lightning.BudgetCallback``.

A LightningModule around the library's tiny GPT (dropout on) is trained by a
plain Trainer and by one with the callback, from the same seed: the losses
(logged at every step) and the trained weights must be identical.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning")

import lightning.pytorch as L

import gradckpt
from gradckpt.integrations.lightning import BudgetCallback
from gradckpt.testing import GPT

BUDGET = 0.7
SEQ, VOCAB = 32, 256


class TinyLM(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(layers=4, d_model=32, heads=4, seq=SEQ, vocab=VOCAB, dropout=0.1)
        self.losses: list[torch.Tensor] = []
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.losses.append(loss.detach())
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (16, SEQ + 1), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=g)


def _fit(callbacks=(), *, steps: int = 3, module=None, **options):
    module = module if module is not None else TinyLM()
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        **options,
    )  # fmt: skip
    L.seed_everything(0, verbose=False)
    trainer.fit(module, _loader())
    return module, trainer


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_losses_and_weights_identical_to_a_plain_run(precision, caplog):
    plain, plain_trainer = _fit(precision=precision)
    # Bit for bit needs a plan without chunking (a chunked loss adds its slices' sums in
    # another order: tests/integrations/test_hf_chunking.py holds it to 1e-5).
    callback = BudgetCallback(BUDGET, repeats=1, chunking=False)
    with caplog.at_level(logging.INFO, logger="gradckpt"):
        planned, trainer = _fit([callback], precision=precision)
    # Planning ran training_step a few times first (this module records every call).
    assert len(planned.losses) > 3 and len(plain.losses) == 3
    for got, want in zip(planned.losses[-3:], plain.losses, strict=True):
        assert torch.equal(got, want)
    for (name, p), q in zip(planned.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    # self.log calls made while planning were dropped: the epoch mean is the plain one.
    assert torch.equal(
        trainer.callback_metrics["train_loss_epoch"],
        plain_trainer.callback_metrics["train_loss_epoch"],
    )
    assert gradckpt.applied_plan(planned) is callback.plan
    report = callback.report
    assert report.measured_peak_bytes <= report.budget_bytes < report.baseline_peak_bytes
    assert report.measured_steps == 2 and report.within_budget
    # Measured over the trainer's steps under the plan (optimizer step included). Lightning
    # zeroes gradients after training_step's forward, so they are planned as resident
    # throughout (set_to_none=False): the prediction bounds the steps, by at most their bytes.
    grads = sum(p.numel() * p.element_size() for p in planned.parameters())
    assert report.measured_peak_bytes <= report.predicted_peak_bytes
    assert report.predicted_peak_bytes <= report.measured_peak_bytes + grads
    assert report.line() in caplog.text


def test_bf16_mixed_is_planned_under_autocast():
    fp32, bf16 = BudgetCallback(BUDGET, repeats=1), BudgetCallback(BUDGET, repeats=1)
    _fit([fp32], steps=1)
    _fit([bf16], steps=1, precision="bf16-mixed")
    assert bf16.report.baseline_peak_bytes < fp32.report.baseline_peak_bytes


def test_manual_optimization_is_refused_before_anything_changes():
    module = TinyLM(manual=True)
    with pytest.raises(ValueError, match="automatic optimization"):
        _fit([BudgetCallback(BUDGET)], module=module)
    assert gradckpt.applied_plan(module) is None


def test_bad_budget_fails_when_the_callback_is_made():
    # The same checks as the Hugging Face callback (both take FirstBatchBudget's).
    with pytest.raises(ValueError, match="budget"):
        BudgetCallback("lots")
    with pytest.raises(TypeError, match="loss_from"):
        BudgetCallback(0.5, loss_from="loss")
    callback = BudgetCallback("2GiB", repeats=1)
    assert (callback.budget, callback.plan_options) == ("2GiB", {"repeats": 1})
    assert callback.plan is None and callback.report is None
