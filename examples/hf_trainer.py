"""Train with the Hugging Face Trainer under a memory budget instead of ``gradient_checkpointing=True``.

A tiny GPT-2 built from a config (random weights, nothing downloaded) learns a
synthetic "count up" language on CPU in seconds. ``BudgetCallback`` plans on the
Trainer's first batch, applies the plan and logs predicted against measured
peak; a second callback generates greedily at each evaluation (with the KV
cache, while training runs without one). The checkpoint it saves loads into a
plain ``GPT2LMHeadModel``.

    python examples/hf_trainer.py                       # budget: 80% of the plain peak
    python examples/hf_trainer.py --budget 3MiB --bf16 --accumulate 2
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from gradckpt.integrations.hf import BudgetCallback

VOCAB, SEQ = 64, 32


class CountingData(torch.utils.data.Dataset):
    """Sequences that count up modulo the vocabulary from a random start."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, VOCAB, (n, 1), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (self.starts[i] + torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids}


class ShowGeneration(TrainerCallback):
    """Greedy continuation of 0 1 2 3 at every evaluation."""

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        out = model.generate(torch.arange(4)[None], max_new_tokens=8, do_sample=False)
        print(f"step {state.global_step}: 0 1 2 3 -> {out[0, 4:].tolist()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.8", help="bytes, '3MiB', or a fraction")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (on CPU too)")
    args = parser.parse_args()
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("gradckpt").setLevel(logging.INFO)  # the plan and its peaks

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    budget_callback = BudgetCallback(budget)
    with tempfile.TemporaryDirectory() as out:
        settings = dict(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
            gradient_accumulation_steps=args.accumulate, bf16=args.bf16,
            learning_rate=3e-3, logging_steps=20, eval_strategy="steps",
            eval_steps=args.steps // 2, save_strategy="steps", save_steps=args.steps,
            report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**settings),
            train_dataset=CountingData(512, seed=1),
            eval_dataset=CountingData(16, seed=2),
            callbacks=[budget_callback, ShowGeneration()],
        )
        trainer.train()
        # The checkpoint is a plain transformers checkpoint.
        reloaded = GPT2LMHeadModel.from_pretrained(f"{out}/checkpoint-{args.steps}")
        same = all(
            torch.equal(a, b)
            for a, b in zip(reloaded.parameters(), trainer.model.parameters())
        )
    report = budget_callback.report
    print(report.line())
    print(f"within budget: {report.within_budget}; checkpoint reloads into a plain model: {same}")


if __name__ == "__main__":
    main()
