"""Small transformers models built from configs with random weights (nothing is downloaded).

Shared by the HF tests, ``benchmarks/hf_models.py`` and the examples: one
function, :func:`hf_example`, builds GPT-2, Llama, BERT, ViT or T5 at the given
sizes with a fixed batch and returns a :class:`gradckpt.testing.Example` whose
``loss_fn`` runs one forward (optionally under autocast) and returns the loss.
Importing this module imports transformers.

Example:
    >>> ex = hf_example("llama", layers=2, hidden=64, seq=32)
    >>> plan = gradckpt.fit(ex.model, ex.loss_fn, budget=0.7)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from torch import nn

from gradckpt.measure.allocator import AllocatorTracker
from gradckpt.measure.beside import BesideReading
from gradckpt.measure.memory import MemoryTracker, state_bytes
from gradckpt.profiling.units import find_blocks
from gradckpt.testing import Example

__all__ = ["HF_MODELS", "Step", "hf_example", "run_step"]

HF_MODELS = ("gpt2", "llama", "bert", "vit", "t5")

Batch = dict[str, torch.Tensor]


def _gpt2(s: dict[str, Any]) -> tuple[nn.Module, Callable[[torch.Generator], Batch]]:
    p = s["dropout"]
    config = tf.GPT2Config(
        n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], vocab_size=s["vocab"],
        n_positions=max(64, s["seq"]), resid_pdrop=p, embd_pdrop=p, attn_pdrop=p,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # transformers warns when it has to guess
    return model, lambda g: _token_batch(g, s, labels=True)


def _llama(s: dict[str, Any]) -> tuple[nn.Module, Callable[[torch.Generator], Batch]]:
    config = tf.LlamaConfig(
        num_hidden_layers=s["layers"], hidden_size=s["hidden"],
        intermediate_size=s["hidden"] * 8 // 3, num_attention_heads=s["heads"],
        num_key_value_heads=max(1, s["heads"] // 2), vocab_size=s["vocab"],
        max_position_embeddings=max(64, s["seq"]), attention_dropout=s["dropout"],
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model, lambda g: _token_batch(g, s, labels=True)


def _bert(s: dict[str, Any]) -> tuple[nn.Module, Callable[[torch.Generator], Batch]]:
    config = tf.BertConfig(
        num_hidden_layers=s["layers"], hidden_size=s["hidden"],
        intermediate_size=4 * s["hidden"], num_attention_heads=s["heads"],
        vocab_size=s["vocab"], max_position_embeddings=max(64, s["seq"]),
        hidden_dropout_prob=s["dropout"], attention_probs_dropout_prob=s["dropout"],
        pad_token_id=0,
    )  # fmt: skip
    return tf.BertForMaskedLM(config), lambda g: _token_batch(g, s, labels=True)


def _vit(s: dict[str, Any]) -> tuple[nn.Module, Callable[[torch.Generator], Batch]]:
    config = tf.ViTConfig(
        num_hidden_layers=s["layers"], hidden_size=s["hidden"],
        intermediate_size=4 * s["hidden"], num_attention_heads=s["heads"],
        image_size=s["image"], patch_size=s["patch"], num_labels=10,
        hidden_dropout_prob=s["dropout"], attention_probs_dropout_prob=s["dropout"],
    )  # fmt: skip

    def batch(g: torch.Generator) -> Batch:
        pixels = torch.randn(s["batch"], 3, s["image"], s["image"], generator=g)
        return {"pixel_values": pixels, "labels": torch.randint(0, 10, (s["batch"],), generator=g)}

    return tf.ViTForImageClassification(config), batch


def _t5(s: dict[str, Any]) -> tuple[nn.Module, Callable[[torch.Generator], Batch]]:
    config = tf.T5Config(
        num_layers=s["layers"], num_decoder_layers=s["layers"], d_model=s["hidden"],
        d_kv=s["hidden"] // s["heads"], d_ff=4 * s["hidden"], num_heads=s["heads"],
        vocab_size=s["vocab"], dropout_rate=s["dropout"], decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip

    def batch(g: torch.Generator) -> Batch:
        shape = (s["batch"], s["seq"])
        return {
            "input_ids": torch.randint(2, s["vocab"], shape, generator=g),
            # decoder side half as long: cross-attention is not square
            "labels": torch.randint(
                2, s["vocab"], (s["batch"], max(2, s["seq"] // 2)), generator=g
            ),
        }

    return tf.T5ForConditionalGeneration(config), batch


def _token_batch(g: torch.Generator, s: dict[str, Any], *, labels: bool) -> Batch:
    ids = torch.randint(1, s["vocab"], (s["batch"], s["seq"]), generator=g)
    return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}


_BUILDERS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit, "t5": _t5}


def hf_example(
    name: str,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seq: int = 32,
    batch: int = 2,
    vocab: int = 128,
    image: int = 32,
    patch: int = 8,
    dropout: float = 0.1,
    seed: int = 0,
    autocast: torch.dtype | None = None,
) -> Example:
    """A transformers model from a config (random weights), a fixed batch and its loss.

    Args:
        name: one of :data:`HF_MODELS`.
        layers, hidden, heads, seq, batch, vocab: sizes (T5 has ``layers`` encoder
            and ``layers`` decoder blocks, and labels half as long as its input).
        image, patch: ViT image side and patch side (``seq`` is unused there).
        dropout: every dropout probability of the config (Llama: attention only).
        seed: weights come from this seed, the batch from a private generator.
        autocast: run the forward under ``torch.autocast`` with this dtype on
            the model's device type (e.g. ``torch.bfloat16``).

    Returns:
        An :class:`~gradckpt.testing.Example` in training mode; ``block_paths``
        are the layers gradckpt finds.

    Example:
        >>> ex = hf_example("t5", layers=2)
        >>> ex.block_paths
        ['encoder.block.0', 'encoder.block.1', 'decoder.block.0', 'decoder.block.1']
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose from {HF_MODELS}")
    sizes = dict(
        layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, vocab=vocab,
        image=image, patch=patch, dropout=dropout,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # weight init draws from the global RNG
        torch.manual_seed(seed)
        model, make_batch = _BUILDERS[name](sizes)
    model.train()
    inputs = make_batch(torch.Generator().manual_seed(seed + 1_000_003))
    device_type = next(model.parameters()).device.type

    def loss_fn() -> torch.Tensor:
        ctx = (
            torch.autocast(device_type, dtype=autocast)
            if autocast is not None
            else contextlib.nullcontext()
        )
        with ctx:
            return model(**inputs).loss

    return Example(name, model, loss_fn, inputs, find_blocks(model))


@dataclass(frozen=True)
class Step:
    """One measured training step: loss, gradients by parameter name, measured peaks.

    ``peak_bytes`` is at the allocator (kernel workspaces included) plus the
    model's parameters and buffers, the level plans are made for;
    ``tensor_peak_bytes`` is the tensor tracker's; ``beside_bytes`` what malloc held
    beside the allocator's blocks at most (autograd's graph, Python objects: on the CPU a
    byte budget holds them too), when asked for.
    """

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    peak_bytes: int
    tensor_peak_bytes: int = 0
    beside_bytes: int = 0

    def max_grad_diff(self, other: Step) -> float:
        """Largest absolute gradient difference; inf if they differ in which params got one."""
        if self.grads.keys() != other.grads.keys():
            return float("inf")
        return max(
            (
                (a.float() - other.grads[k].float()).abs().max().item()
                for k, a in self.grads.items()
            ),
            default=0.0,
        )


def run_step(example: Example, seed: int = 0, beside: bool = False) -> Step:
    """Seed, run ``loss_fn().backward()`` measured at the allocator and by the tensor tracker.

    With ``beside``, also what malloc held beside the allocator's blocks, less what the
    step left held (a library's one-time buffer, :class:`~gradckpt.measure.beside.
    BesideReading`): with ``peak_bytes``, the step's memory at the level a byte budget is
    held on the CPU. The tensor tracker's own records would read as beside, so it does
    not run then (``tensor_peak_bytes`` 0). Gradients are cleared after.

    Example:
        >>> plain = run_step(ex); gradckpt.fit(ex.model, ex.loss_fn, 0.7)
        >>> run_step(ex).max_grad_diff(plain)
        0.0
    """
    model = example.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    tracking = contextlib.nullcontext(None) if beside else MemoryTracker(model)
    with AllocatorTracker() as allocator, tracking as tracker:
        reading = BesideReading(allocator, less_kept=True) if beside else None
        loss = example.loss_fn()
        if reading is not None:
            reading.forward_done(loss)
        loss.backward()
    held = reading.bytes() if reading is not None else 0
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    peak = state_bytes(model) + allocator.peak_bytes
    return Step(loss.detach(), grads, peak, tracker.peak_bytes if tracker else 0, held)
