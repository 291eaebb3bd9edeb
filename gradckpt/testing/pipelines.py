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

import torch
import torch.nn.functional as F
from torch import nn

from gradckpt.testing.gpts import CausalSelfAttention, GPTBlock

__all__ = ["FirstStage", "LastStage", "MiddleStage", "gpt_stages", "next_token_loss"]


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm block with RMSNorm and a SwiGLU MLP (hidden ~8/3 d)."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout)
        self.norm2 = nn.RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, 8 * d_model // 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _blocks(kind: str, n: int, d_model: int, heads: int, dropout: float) -> nn.ModuleList:
    block = {"gpt": GPTBlock, "llama": LlamaBlock}[kind]
    return nn.ModuleList(block(d_model, heads, dropout) for _ in range(n))


class FirstStage(nn.Module):
    """Token and position embeddings, then blocks: ``(B, T)`` ids to ``(B, T, C)``."""

    def __init__(self, kind: str, n: int, d_model: int, heads: int, seq: int, vocab: int,
                 dropout: float) -> None:  # fmt: skip
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq, d_model)
        self.blocks = _blocks(kind, n, d_model, heads, dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class MiddleStage(nn.Module):
    """Blocks only: ``(B, T, C)`` to ``(B, T, C)``."""

    def __init__(self, kind: str, n: int, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.blocks = _blocks(kind, n, d_model, heads, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(MiddleStage):
    """Blocks, the final norm and the head: ``(B, T, C)`` to logits ``(B, T, vocab)``."""

    def __init__(self, kind: str, n: int, d_model: int, heads: int, vocab: int,
                 dropout: float) -> None:  # fmt: skip
        super().__init__(kind, n, d_model, heads, dropout)
        self.norm = nn.LayerNorm(d_model) if kind == "gpt" else nn.RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(super().forward(x)))


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
) -> list[nn.Module]:
    """A decoder of ``layers`` blocks in ``num_stages`` stage modules (blocks split evenly,
    or as ``per_stage`` says), built from ``seed``; ``kind`` is "gpt" or "llama".

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
    stages: list[nn.Module] = [FirstStage(kind, counts[0], d_model, heads, seq, vocab, dropout)]
    stages += [MiddleStage(kind, n, d_model, heads, dropout) for n in counts[1:-1]]
    stages.append(LastStage(kind, counts[-1], d_model, heads, vocab, dropout))
    for stage in stages:
        for m in stage.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
    return stages
