"""``TokenChunkedForward``: a token-wise module run in slices of tokens (#41 item 3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradckpt.engine.chunking.token_wise import TokenChunkedForward


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 16))


def _grads(mlp: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_()
    out = mlp(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [x.grad, *(p.grad.clone() for p in mlp.parameters())]
    mlp.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("shape,chunks", [((2, 48, 16), 4), ((3, 50, 16), 7), ((50, 16), 64)])
def test_slices_give_the_plain_result_and_gradients(shape, chunks):
    mlp = _mlp()
    x = torch.randn(shape)
    ref, ref_grads = _grads(mlp, x)
    mlp.forward = TokenChunkedForward(mlp.forward, chunks, name="mlp")
    out, grads = _grads(mlp, x)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        assert (g - r).norm() <= 1e-5 * r.norm()


def test_without_gradients_or_when_removed_it_is_the_plain_forward():
    mlp = _mlp()
    plain = mlp.forward
    chunked = TokenChunkedForward(plain, 4)
    assert chunked.__gradckpt_original__ == plain
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        torch.testing.assert_close(chunked(x), plain(x), rtol=0, atol=0)
    chunked.active = False
    torch.testing.assert_close(chunked(x), plain(x), rtol=0, atol=0)


class _Block(nn.Module):
    """A pre-norm block around a chunkable MLP; ``after`` adds a LayerNorm past the MLP
    (the block then saves a tensor after the chunk)."""

    def __init__(self, after: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16)
        self.mlp = _mlp()
        self.after = nn.LayerNorm(16) if after else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(self.norm(x))
        return self.after(x) if self.after is not None else x


def _recomputed_block_step(block: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Matmul FLOPs of a step through ``block`` recomputed as one region, and its grads."""
    from gradckpt import checkpoint
    from gradckpt.measure.flops import count_matmul_flops

    x = x.detach().requires_grad_()

    def step() -> None:
        out = checkpoint(block, x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()

    flops = count_matmul_flops(step)
    grads = [x.grad, *(p.grad.clone() for p in block.parameters())]
    block.zero_grad(set_to_none=True)
    return flops, grads


@pytest.mark.parametrize("chunks", [2, 4])
def test_in_a_recomputed_block_deferred_slices_run_no_mlp_twice_with_the_same_gradients(chunks):
    """The block's recompute opens the slices' regions without running them: the MLP's
    matmuls run in backward once (each slice's own recompute), as without slices;
    run, every slice before the last ran whole there (its second linear too)."""
    x = torch.randn(2, 24, 16)
    block = _Block()
    unchunked_flops, _ = _recomputed_block_step(block, x)
    plain = block.mlp.forward
    block.mlp.forward = TokenChunkedForward(plain, chunks, name="mlp", deferrable=False)
    ran_flops, ran_grads = _recomputed_block_step(block, x)
    block.mlp.forward = TokenChunkedForward(plain, chunks, name="mlp", deferrable=True)
    deferred_flops, deferred_grads = _recomputed_block_step(block, x)
    assert deferred_flops == unchunked_flops < ran_flops
    for got, want in zip(deferred_grads, ran_grads):
        assert torch.equal(got, want)  # the same slices, the same sums


def test_a_block_that_saves_after_the_chunk_runs_its_slices_in_the_recompute():
    x = torch.randn(2, 24, 16)
    block = _Block(after=True)
    plain = block.mlp.forward
    block.mlp.forward = TokenChunkedForward(plain, 4, name="mlp", deferrable=False)
    ran_flops, ran_grads = _recomputed_block_step(block, x)
    block.mlp.forward = TokenChunkedForward(plain, 4, name="mlp", deferrable=True)
    flops, grads = _recomputed_block_step(block, x)
    assert flops == ran_flops  # the LayerNorm past the MLP needs its output
    for got, want in zip(grads, ran_grads):
        assert torch.equal(got, want)


def test_deferred_slices_hold_under_two_backward_passes_and_autograd_grad():
    x = torch.randn(2, 24, 16, requires_grad=True)
    block = _Block()
    block.mlp.forward = TokenChunkedForward(block.mlp.forward, 3, name="mlp", deferrable=True)
    from gradckpt import checkpoint

    out = checkpoint(block, x)
    first = torch.autograd.grad(out.sum(), [x, *block.parameters()], retain_graph=True)
    second = torch.autograd.grad(out.sum(), [x, *block.parameters()])
    for a, b in zip(first, second):
        assert torch.equal(a, b)
