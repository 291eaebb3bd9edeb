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
