"""Models shaped like the libraries people train with, for block discovery to find their blocks.

Each builder returns an :class:`Example` whose module *tree* follows one
library's layout (the names, containers and class nesting a person would meet),
at toy sizes; ``block_paths`` is what a person would call the blocks there:

* ``titan_llama``: torchtitan's Llama: blocks in a ``ModuleDict`` keyed ``"0"``,
  ``"1"``, ...; fused QKV; RoPE; RMSNorm; a SwiGLU whose ``w1``, ``w2``, ``w3`` are
  one ``nn.Linear`` subclass (numbered children of one class, inside each block).
* ``litgpt``: litgpt's GPT: ``transformer.h`` of ``Block`` with ``attn.qkv`` and
  an ``LLaMAMLP`` of ``fc_1``, ``fc_2``, ``proj``.
* ``moe_llama``: a decoder whose blocks hold a ``ModuleList`` of expert MLPs
  (repeated inside each repeated block; the routing runs in the block's code).
* ``timm_swin``: stages of blocks with a patch merging between (timm, MONAI's
  SwinUNETR encoder): the blocks, not the stages.
* ``monai_unet``: MONAI's recursive ``UNet``: ``Sequential(down, SkipConnection(
  Sequential(...)), up)`` nested per level, residual units inside.

Example:
    >>> ex = wild("titan_llama")
    >>> ex.block_paths[:2]
    ['layers.0', 'layers.1']
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from gradckpt.testing.example import Device, Example, Inputs, build_example

__all__ = ["TORCHTITAN_SAVE", "WILD", "torchtitan_sac", "wild"]


def _token_inputs(batch: int, seq: int, vocab: int) -> Callable[[torch.Generator], Inputs]:
    def make(g: torch.Generator) -> Inputs:
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return {"idx": t[:, :-1].contiguous(), "targets": t[:, 1:].contiguous()}

    return make


def _lm_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    logits = model(inputs["idx"])
    return F.cross_entropy(logits.flatten(0, 1), inputs["targets"].flatten())


# ----------------------------------------------------------------- torchtitan Llama


class Linear(nn.Linear):
    """torchtitan-style ``nn.Linear`` subclass (its own init hooks in the real code)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _rope(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, D): rotate pairs by position
    t, d = x.shape[-2], x.shape[-1]
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device) / d))
    angles = torch.outer(torch.arange(t, device=x.device), freqs)  # (T, D/2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = Linear(dim, 3 * dim, bias=False)
        self.wo = Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> same
        b, t, c = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, hidden), Linear(hidden, dim), Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = ffn if ffn is not None else FeedForward(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int, moe: int = 0) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(dim, heads, MoE(dim, moe) if moe else None)
             for i in range(layers)}
        )  # fmt: skip
        self.norm = RMSNorm(dim)
        self.output = Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        h = self.tok_embeddings(idx)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


# ----------------------------------------------------------------- a mixture of experts


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing over a ``ModuleList`` of experts; every expert runs on every token
    (weights zero where not routed), so the step's ops do not depend on the data."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, 2 * dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)  # (B, T, E)
        top = F.one_hot(gates.argmax(-1), gates.shape[-1]).to(x.dtype) * gates
        return sum(top[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


# ----------------------------------------------------------------- litgpt


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class LLaMAMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = LLaMAMLP(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class LitGPT(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer = nn.ModuleDict(
            {"wte": nn.Embedding(vocab, dim),
             "h": nn.ModuleList(Block(dim, heads) for _ in range(layers)),
             "ln_f": RMSNorm(dim)}
        )  # fmt: skip

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ----------------------------------------------------------------- Swin-style stages


class WindowBlock(nn.Module):
    """A transformer block over windows of tokens (the shifts left out)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, W, C) -> same
        b, h, w, c = x.shape
        tokens = x.reshape(b, h * w, c)
        y = self.norm1(tokens)
        tokens = tokens + self.attn(y, y, y, need_weights=False)[0]
        return (tokens + self.mlp(self.norm2(tokens))).reshape(b, h, w, c)


class PatchMerging(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, W, C) -> (B, H/2, W/2, 2C)
        x = torch.cat([x[:, i::2, j::2] for i in (0, 1) for j in (0, 1)], -1)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, merge: bool) -> None:
        super().__init__()
        self.downsample = PatchMerging(dim // 2) if merge else nn.Identity()
        self.blocks = nn.Sequential(*(WindowBlock(dim, heads) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class Swin(nn.Module):
    def __init__(self, dim: int, depths: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.layers = nn.Sequential(
            *(SwinStage(dim * 2**i, d, 2, merge=i > 0) for i, d in enumerate(depths))
        )
        self.head = nn.Linear(dim * 2 ** (len(depths) - 1), classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        x = self.layers(self.patch_embed(x).permute(0, 2, 3, 1))
        return self.head(x.mean((1, 2)))


# ----------------------------------------------------------------- MONAI's recursive UNet


class ResidualUnit(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1), nn.InstanceNorm2d(c_out), nn.PReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1), nn.InstanceNorm2d(c_out), nn.PReLU(),
        )  # fmt: skip
        self.residual = nn.Conv2d(c_in, c_out, 3, stride, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + self.residual(x)


class SkipConnection(nn.Module):
    def __init__(self, submodule: nn.Module) -> None:
        super().__init__()
        self.submodule = submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.submodule(x)], dim=1)


class Up(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose2d(c_in, c_out, 3, 2, 1, output_padding=1)
        self.unit = ResidualUnit(c_out, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unit(self.conv(x))


def _monai_level(channels: tuple[int, ...], c_in: int) -> nn.Module:
    c = channels[0]
    if len(channels) == 1:
        return ResidualUnit(c_in, c, 1)  # the bottom
    inner = _monai_level(channels[1:], c)
    inner_out = channels[1] if len(channels) == 2 else c  # the bottom keeps its width
    return nn.Sequential(ResidualUnit(c_in, c, 2), SkipConnection(inner), Up(c + inner_out, c_in))


class MonaiUNet(nn.Module):
    def __init__(self, channels: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.model = _monai_level(channels, 8)
        self.stem = nn.Conv2d(3, 8, 3, 1, 1)
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes, H, W)
        return self.head(self.model(self.stem(x)))


def _seg_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    return F.cross_entropy(model(inputs["x"]), inputs["y"])


# ----------------------------------------------------------------- torchtitan's selective AC

_aten = torch.ops.aten
#: torchtitan's default save list for per-op selective checkpointing (and the CPU kernel
#: of scaled dot-product attention, where it runs here).
TORCHTITAN_SAVE = frozenset({
    _aten.mm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.max.default,
})  # fmt: skip


def torchtitan_sac(forward: Callable) -> Callable:
    """``forward`` under torch's selective checkpointing with torchtitan's default policy:
    keep the outputs of :data:`TORCHTITAN_SAVE`'s ops, but recompute every second matmul.

    Example:
        >>> block.forward = torchtitan_sac(block.forward)
    """

    def policy_for(counts: dict[str, int]) -> Callable:
        def policy(ctx: object, func: object, *args: object, **kwargs: object) -> object:
            mode = "recompute" if ctx.is_recompute else "forward"  # type: ignore[attr-defined]
            if func == _aten.mm.default:
                counts[mode] += 1
            keep = func in TORCHTITAN_SAVE and not (
                func == _aten.mm.default and counts[mode] % 2 == 0
            )
            return (
                torch_checkpoint.CheckpointPolicy.MUST_SAVE
                if keep
                else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
            )

        return policy

    def context() -> tuple:
        return torch_checkpoint.create_selective_checkpoint_contexts(policy_for(defaultdict(int)))

    def run(*args: object, **kwargs: object) -> object:
        return torch_checkpoint.checkpoint(
            forward, *args, use_reentrant=False, context_fn=context, **kwargs
        )

    return run


# ----------------------------------------------------------------- builders


def wild(
    name: str,
    *,
    layers: int = 4,
    dim: int = 64,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 512,
    batch: int = 2,
    image: int = 32,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """The model ``name`` of :data:`WILD` with what a person would call its blocks.

    Example:
        >>> wild("litgpt", layers=2).block_paths
        ['transformer.h.0', 'transformer.h.1']
    """
    if name not in WILD:
        raise KeyError(f"unknown model {name!r}; choose from {sorted(WILD)}")
    tokens = _token_inputs(batch, seq, vocab)
    if name in ("titan_llama", "moe_llama"):
        moe = 4 if name == "moe_llama" else 0
        return build_example(
            name, seed, dtype, device, lambda: TitanLlama(layers, dim, heads, vocab, moe),
            tokens, _lm_loss, [f"layers.{i}" for i in range(layers)],
        )  # fmt: skip
    if name == "litgpt":
        return build_example(
            name, seed, dtype, device, lambda: LitGPT(layers, dim, heads, vocab),
            tokens, _lm_loss, [f"transformer.h.{i}" for i in range(layers)],
        )  # fmt: skip

    def images(g: torch.Generator) -> Inputs:
        x = torch.randn(batch, 3, image, image, generator=g)
        labels = (batch,) if name == "timm_swin" else (batch, image, image)
        return {"x": x, "y": torch.randint(0, 4, labels, generator=g)}

    if name == "timm_swin":
        depths = (2, 2)
        paths = [f"layers.{s}.blocks.{b}" for s, d in enumerate(depths) for b in range(d)]
        return build_example(
            name, seed, dtype, device, lambda: Swin(dim // 2, depths, 4), images, _seg_loss, paths
        )
    # monai_unet: the residual units going down, the up blocks, and the innermost skip
    # connection (the bottom's unit and its concatenation; its outer twin holds blocks).
    paths = ["model.0", "model.1.submodule.0", "model.1.submodule.1", "model.1.submodule.2",
             "model.2"]  # fmt: skip
    return build_example(
        name, seed, dtype, device, lambda: MonaiUNet((16, 32, 64), 4), images, _seg_loss, paths
    )


#: The layouts :func:`wild` builds.
WILD = ("titan_llama", "moe_llama", "litgpt", "timm_swin", "monai_unet")
