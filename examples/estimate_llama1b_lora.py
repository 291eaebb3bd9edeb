"""The estimate of issue #41: a Llama-3.2-1B-shaped model with LoRA, one sequence of 4,096 tokens.

bf16 weights, vocabulary 128,256, LoRA r=16 on every projection (q, k, v, o, gate,
up, down), AdamW. Built on the meta device: ``gradckpt estimate`` plans it under
fake tensors, so nothing is allocated.

    gradckpt estimate examples/estimate_llama1b_lora.py:make --optimizer adamw --budget least
    gradckpt estimate examples/estimate_llama1b_lora.py:make_tied --optimizer adamw --budget least

``make`` keeps the LM head's own weight (the shape the issue measured: 2.83 GiB of
parameters); ``make_tied`` ties it to the embeddings (2.34 GiB).
"""

from __future__ import annotations

from typing import Any

import torch


def _build(tied: bool) -> tuple[Any, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=tied, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        base = LlamaForCausalLM(config).to(torch.bfloat16).train()
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=projections))

    def loss_fn() -> torch.Tensor:
        device = next(model.parameters()).device
        ids = torch.randint(0, config.vocab_size, (1, 4096), device=device)
        return model(input_ids=ids, labels=ids).loss

    return model, loss_fn


def make() -> tuple[Any, Any]:
    """The model and its one-sequence loss (the LM head's own weight)."""
    return _build(tied=False)


def make_tied() -> tuple[Any, Any]:
    """The same with the LM head tied to the embeddings."""
    return _build(tied=True)
