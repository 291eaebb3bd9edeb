"""Small decoders split into pipeline stages, for tests, benchmarks and the example.

The first stage holds the embeddings and its share of the blocks, the last its
blocks, the final norm and the vocabulary head (untied: the stages share no
parameter); the schedule's loss is :func:`next_token_loss`. ``kind="llama"``
uses RMSNorm and a SwiGLU MLP (no rotary embedding: its memory is the same).

Example:
    >>> stages = gpt_stages(2, layers=4, d_model=64, heads=4, seq=32, vocab=256)
    >>> [type(s).__name__ for s in stages]
    ['FirstStage', 'LastStage']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradckpt.testing.gpts import CausalSelfAttention, GPTBlock

__all__ = [
    "Decoder",
    "FirstStage",
    "LastStage",
    "MiddleStage",
    "decoder",
    "gpt_stages",
    "next_token_loss",
]


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GroupedAttention(nn.Module):
    """Causal attention with ``kv_heads`` key/value heads shared by groups of query heads."""

    def __init__(self, d_model: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.kv = nn.Linear(d_model, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class LlamaBlock(nn.Module):
    """Pre-norm block with RMSNorm and a SwiGLU MLP (hidden ~8/3 d unless given); with
    ``kv_heads``, grouped-query attention."""

    def __init__(self, d_model: int, heads: int, dropout: float, hidden: int | None = None,
                 kv_heads: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.attn: nn.Module = (
            GroupedAttention(d_model, heads, kv_heads) if kv_heads
            else CausalSelfAttention(d_model, heads, dropout)
        )  # fmt: skip
        self.norm2 = nn.RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, hidden or 8 * d_model // 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


Block = Callable[[], nn.Module]


class FirstStage(nn.Module):
    """Token and position embeddings, then blocks: ``(B, T)`` ids to ``(B, T, C)``."""

    def __init__(self, block: Block, n: int, d_model: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class MiddleStage(nn.Module):
    """Blocks only: ``(B, T, C)`` to ``(B, T, C)``."""

    def __init__(self, block: Block, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(MiddleStage):
    """Blocks, the final norm and the head: ``(B, T, C)`` to logits ``(B, T, vocab)``."""

    def __init__(self, block: Block, n: int, d_model: int, vocab: int, rms: bool) -> None:
        super().__init__(block, n)
        self.norm = nn.RMSNorm(d_model) if rms else nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(super().forward(x)))


class Decoder(nn.Module):
    """The whole decoder, unsplit: for ``torch.distributed.pipelining.pipeline()`` to split
    at ``SplitPoint``s (``blocks.<i>``). Its parts are the stage modules' own.

    Example:
        >>> model = decoder(layers=4)
        >>> [n for n, _ in model.named_children()]
        ['tok_emb', 'pos_emb', 'blocks', 'norm', 'lm_head']
    """

    def __init__(self, first: FirstStage, middle: list[MiddleStage], last: LastStage) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = first.tok_emb, first.pos_emb
        parts = [first, *middle, last]
        self.blocks = nn.ModuleList(block for part in parts for block in part.blocks)
        self.norm, self.lm_head = last.norm, last.lm_head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def decoder(**options: Any) -> Decoder:
    """The decoder :func:`gpt_stages` builds (the same options and weights), in one module.

    Example:
        >>> len(decoder(layers=6).blocks)
        6
    """
    first, *middle, last = gpt_stages(2, **options)
    return Decoder(first, middle, last)  # type: ignore[arg-type]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position (the schedule's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_stages(
    num_stages: int,
    *,
    layers: int = 4,
    d_model: int = 64,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 256,
    dropout: float = 0.0,
    kind: str = "gpt",
    seed: int = 0,
    per_stage: list[int] | None = None,
    hidden: int | None = None,
    kv_heads: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> list[nn.Module]:
    """A decoder of ``layers`` blocks in ``num_stages`` stage modules (blocks split evenly,
    or as ``per_stage`` says), built from ``seed``; ``kind`` is "gpt" or "llama" (then
    ``hidden``: the MLP's size, ``kv_heads``: grouped-query attention). ``device="meta"``
    builds it without memory, for fake planning.

    Example:
        >>> [len(s.blocks) for s in gpt_stages(2, layers=8)]
        [4, 4]
    """
    if num_stages < 2:
        raise ValueError(f"a pipeline has at least 2 stages, got {num_stages}")
    if kind not in ("gpt", "llama"):
        raise ValueError(f"kind is 'gpt' or 'llama', got {kind!r}")
    counts = per_stage or [layers // num_stages + (i < layers % num_stages)
                           for i in range(num_stages)]  # fmt: skip
    if len(counts) != num_stages:
        raise ValueError(f"per_stage has {len(counts)} entries for {num_stages} stages")
    torch.manual_seed(seed)

    def block() -> nn.Module:
        if kind == "gpt":
            return GPTBlock(d_model, heads, dropout)
        return LlamaBlock(d_model, heads, dropout, hidden, kv_heads)

    with torch.device(device or "cpu"):
        stages: list[nn.Module] = [FirstStage(block, counts[0], d_model, seq, vocab)]
        stages += [MiddleStage(block, n) for n in counts[1:-1]]
        stages.append(LastStage(block, counts[-1], d_model, vocab, kind == "llama"))
    if dtype is not None:
        stages = [s.to(dtype) for s in stages]
    if str(device) == "meta":
        return stages
    for stage in stages:
        for m in stage.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
    return stages
