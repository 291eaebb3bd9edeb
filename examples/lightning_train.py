"""Train a LightningModule under a memory budget: ``BudgetCallback`` plans its ``training_step``.

The module wraps gradckpt's tiny GPT (``gradckpt.testing.GPT``, random weights)
and learns a synthetic "count up" language on CPU in seconds. The callback plans
on the first batch, applies the plan and logs predicted against measured peak.

    python examples/lightning_train.py                  # budget: 70% of the plain peak
    python examples/lightning_train.py --budget 4MiB --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import logging

import lightning.pytorch as L
import torch
import torch.nn.functional as F

from gradckpt.integrations.lightning import BudgetCallback
from gradckpt.testing import GPT

SEQ, VOCAB = 64, 128


class CountingLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(layers=6, d_model=64, heads=4, seq=SEQ, vocab=VOCAB, dropout=0.1)

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def counting_data(n: int) -> torch.utils.data.DataLoader:
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(1))
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.7", help="bytes, '4MiB', or a fraction")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed")
    args = parser.parse_args()
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("gradckpt").setLevel(logging.INFO)

    L.seed_everything(0, verbose=False)
    callback = BudgetCallback(budget)
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, precision=args.precision,
        logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[callback],
    )  # fmt: skip
    module = CountingLM()
    trainer.fit(module, counting_data(8 * args.steps))
    print(callback.report.line())
    print(f"final loss {trainer.callback_metrics['loss']:.3f}; within budget: "
          f"{callback.report.within_budget}")


if __name__ == "__main__":
    main()
