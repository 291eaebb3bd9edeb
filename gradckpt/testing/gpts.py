"""A GPT-2-like decoder: attention, tied embeddings and a vocabulary-sized head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradckpt.testing.example import Device, Example, Inputs, build_example


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)  # fused q, k, v projection
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        # (B, H, T, C/H). With dropout_p > 0 on CPU this takes the math path, which
        # materialises (B, H, T, T) scores; the flash kernel is used when dropout is off.
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C), a copy: heads back side by side
        return self.resid_drop(self.proj(y))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        return self.drop(self.proj(self.act(self.fc(x))))  # hidden (B, T, 4C)


class GPTBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, layers: int, d_model: int, heads: int, seq: int, vocab: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)  # embedding dropout: an RNG draw before the first block
        self.blocks = nn.ModuleList(GPTBlock(d_model, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        for m in self.modules():  # GPT-2 init; N(0, 1) embeddings would give huge tied logits
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.lm_head.weight = self.tok_emb.weight  # tied: one (vocab, C) parameter, two uses

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) -> logits (B, T, vocab)
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _next_token_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    logits = model(inputs["idx"])  # (B, T, V)
    # targets are the inputs shifted by one, stored contiguous so the view costs nothing
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), inputs["targets"].view(-1))


def gpt(
    *,
    layers: int = 4,
    d_model: int = 64,
    heads: int = 4,
    seq: int = 64,
    vocab: int = 4096,
    batch: int = 4,
    dropout: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """GPT-2-like decoder with tied embeddings; blocks are ``blocks.0 .. blocks.{layers-1}``.

    The default vocabulary makes the logits (B*T*vocab) outweigh one block's saved
    activations, so the head and the loss matter for the peak, as in real LMs.

    >>> gpt(layers=2).inputs["idx"].shape
    torch.Size([4, 64])
    """
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")

    def tokens(g: torch.Generator) -> Inputs:
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)  # (B, T+1)
        return {"idx": t[:, :-1].contiguous(), "targets": t[:, 1:].contiguous()}

    return build_example(
        "gpt", seed, dtype, device,
        lambda: GPT(layers, d_model, heads, seq, vocab, dropout),
        tokens, _next_token_loss, [f"blocks.{i}" for i in range(layers)],
    )  # fmt: skip
