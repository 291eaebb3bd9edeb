"""PEFT LoRA on the small transformers models of :mod:`gradckpt.integrations.hf.zoo`.

``peft.get_peft_model(base, LoraConfig(...))`` needs nothing from gradckpt: the
base's decoder layers are still the blocks (PEFT swaps the targeted linears for
``lora.Linear`` modules inside them), ``use_cache`` is handled as for the bare
model, and gradckpt's checkpoint is non-reentrant, so a frozen base whose layer
inputs do not require grad still gives the adapters their gradients (no
``enable_input_require_grads()``). This module builds such models for tests,
benchmarks and examples; importing it imports transformers and peft.

Example:
    >>> ex = lora_example("llama", layers=2)
    >>> plan = gradckpt.fit(ex.model, ex.loss_fn, budget=0.8)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from gradckpt.integrations.hf.zoo import hf_example
from gradckpt.profiling.units import find_blocks
from gradckpt.testing import Example

__all__ = ["LORA_TARGETS", "adapter_names", "lora_example"]

# Llama's query/value projections; GPT-2's fused qkv (a Conv1D, weight stored (in, out)).
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def lora_example(
    name: str, *, rank: int = 4, lora_dropout: float = 0.1, seed: int = 0, **sizes: Any
) -> Example:
    """A :func:`hf_example` model wrapped by ``get_peft_model`` with LoRA on attention.

    The base is frozen (PEFT does that); ``lora_B`` is drawn from N(0, 0.02)
    instead of PEFT's zeros so that ``lora_A`` gets a nonzero gradient at step one.

    Args:
        name: "llama" or "gpt2".
        rank, lora_dropout: LoRA rank and dropout.
        seed: weights (base and adapters) and batch seed.
        **sizes: passed to :func:`hf_example` (layers, hidden, seq, batch, autocast, ...).

    Example:
        >>> ex = lora_example("gpt2", layers=3)
        >>> sorted(adapter_names(ex.model))[:1]
        ['base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight']
    """
    if name not in LORA_TARGETS:
        raise ValueError(f"no LoRA targets known for {name!r}; choose from {sorted(LORA_TARGETS)}")
    base = hf_example(name, seed=seed, **sizes)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=lora_dropout,
        target_modules=LORA_TARGETS[name], fan_in_fan_out=name == "gpt2",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = get_peft_model(base.model, config)
        for module_name, param in model.named_parameters():
            if "lora_B" in module_name:
                nn.init.normal_(param, std=0.02)
    model.train()
    inputs, autocast = base.inputs, sizes.get("autocast")

    def loss_fn() -> torch.Tensor:
        ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            return model(**inputs).loss

    return Example(f"{name}+lora", model, loss_fn, inputs, find_blocks(model))


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the trainable (adapter) parameters.

    Example:
        >>> len(adapter_names(lora_example("llama", layers=2).model))
        8
    """
    return [n for n, p in model.named_parameters() if p.requires_grad]
