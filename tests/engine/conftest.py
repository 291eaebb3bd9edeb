"""Shared fixtures for the engine tests: tiny models and grad capture.

Every test compares a checkpointed run with the plain (uncheckpointed) run from
the same seed, so the fixtures here build models deterministically and collect
outputs and gradients in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn


def build(make: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def run_step(
    model: nn.Module | None,
    call: Callable[..., Any],
    *inputs: torch.Tensor,
    seed: int = 1,
) -> dict[str, Any]:
    """Seed, run ``call(*inputs)``, backward a weighted sum; return output and grads."""
    if model is not None:
        model.zero_grad(set_to_none=True)
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    torch.manual_seed(seed)
    out = call(*leaves)
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    return {
        "out": out.detach(),
        "input_grads": [x.grad for x in leaves],
        "param_grads": ([p.grad for p in model.parameters()] if model is not None else []),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bitwise equality of outputs and of every gradient (None must match None)."""
    assert torch.equal(a["out"], b["out"])
    for key in ("input_grads", "param_grads"):
        assert len(a[key]) == len(b[key])
        for ga, gb in zip(a[key], b[key]):
            assert (ga is None) == (gb is None)
            if ga is not None:
                assert torch.equal(ga, gb)


@pytest.fixture
def step() -> Callable[..., dict[str, Any]]:
    return run_step


@pytest.fixture
def same() -> Callable[[dict[str, Any], dict[str, Any]], None]:
    return assert_same


@pytest.fixture
def make_model() -> Callable[..., nn.Module]:
    return build


def mlp(width: int = 8, depth: int = 4, p: float = 0.5) -> nn.Sequential:
    """Linear/GELU/Dropout blocks: every layer saves something for backward."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(p)]
    return nn.Sequential(*layers)


@pytest.fixture
def mlp_factory() -> Callable[..., nn.Sequential]:
    return mlp
