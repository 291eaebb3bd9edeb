"""Fine-tune a Hugging Face transformers model under a memory budget, on CPU in seconds.

The model is a tiny GPT-2 built from a config with random weights (nothing is
downloaded), trained on a synthetic "count up" language. Two ways in:

1. ``gradckpt.fit(model, loss_fn, budget)``: gradckpt finds the decoder layers,
   measures a step, and applies the plan with the least recompute whose peak
   fits the budget (``use_cache`` is turned off for training, said once).
2. ``gradckpt.integrations.hf.enable(model, policy=...)``: transformers' usual
   per-layer switch, run by ``gradckpt.checkpoint`` with a per-op policy.

With ``--lora`` the base is frozen and only hand-written LoRA adapters train:
nothing entering a layer requires grad, which gradckpt (non-reentrant) handles
without ``enable_input_require_grads()``.

    python examples/hf_finetune.py                 # fit at 60% of the plain peak
    python examples/hf_finetune.py --lora --budget 0.7
    python examples/hf_finetune.py --switch        # transformers' switch + gradckpt
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import gradckpt
from gradckpt.integrations import hf
from gradckpt.measure import MemoryTracker, format_bytes

VOCAB, SEQ, BATCH = 64, 32, 8


def build() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).train()


def batch(step: int) -> torch.Tensor:
    """Sequences that count up modulo the vocabulary from a random start: easy to learn."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB


class LoRA(nn.Module):
    """``base(x) + scale * B(A(x))``; transformers' Conv1D stores its weight as (in, out)."""

    def __init__(self, base: nn.Module, rank: int = 8) -> None:
        super().__init__()
        d_in, d_out = base.weight.shape
        self.base, self.a, self.b = (
            base,
            nn.Linear(d_in, rank, bias=False),
            nn.Linear(rank, d_out, bias=False),
        )
        nn.init.zeros_(self.b.weight)  # starts as the base model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + 2.0 * self.b(self.a(x))


def add_lora(model: GPT2LMHeadModel) -> None:
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h:
        block.attn.c_attn = LoRA(block.attn.c_attn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.6, help="fraction of the plain peak")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lora", action="store_true", help="frozen base, LoRA adapters")
    parser.add_argument("--switch", action="store_true", help="hf.enable instead of gradckpt.fit")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest and steady on a shared CPU
    warnings.simplefilter("default")  # show gradckpt's one message about use_cache

    model = build()
    if args.lora:
        add_lora(model)
    ids = batch(0)

    def loss_fn() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    plain = MemoryTracker.measure(model, lambda: loss_fn().backward())
    model.zero_grad(set_to_none=True)
    if args.switch:
        # transformers' placement (every layer), gradckpt's mechanism and per-op policy
        hf.enable(model, policy=gradckpt.policies.save_matmuls)
        budget = None
    else:
        plan = gradckpt.fit(model, loss_fn, budget=args.budget)
        print(plan.summary())
        budget = plan.budget_bytes

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=5e-2 if args.lora else 2e-3)
    start = time.perf_counter()
    for step in range(args.steps):
        ids = batch(step)  # loss_fn reads the new batch
        if step == 0:
            with MemoryTracker(model) as mt:
                loss = loss_fn()
                loss.backward()
        else:
            loss = loss_fn()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    took = time.perf_counter() - start

    print(f"\nplain peak   {format_bytes(plain.peak_bytes)}")
    print(f"trained peak {format_bytes(mt.peak_bytes)} (first step, before optimizer state)")
    if budget is not None:
        print(
            f"budget       {format_bytes(budget)}: {'met' if mt.peak_bytes <= budget else 'MISSED'}"
        )
    print(f"{args.steps} steps in {took:.1f} s, {len(trainable)} trainable tensors")


if __name__ == "__main__":
    main()
