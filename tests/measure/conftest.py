"""Shared helpers for the measurement tests: a bare watcher mode, the residual MLP,
and a malloc-level counter preloaded into a child interpreter.

The counter is a tiny C library (:mod:`gradckpt.testing.malloc_counter`): it wraps
glibc's malloc family and keeps the live and peak bytes (by ``malloc_usable_size``);
the child reads them through ``ctypes.CDLL(None)``: ``gck_current()``, ``gck_peak()``,
``gck_reset_peak()``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradckpt.measure import StorageWatcher
from gradckpt.testing.malloc_counter import build_counter
from gradckpt.testing.malloc_counter import run_counted as counted_child


class WatchMode(TorchDispatchMode):
    """Feeds every op's output to a StorageWatcher and logs its callbacks."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int, int | None]] = []
        self.watcher = StorageWatcher(
            on_alloc=lambda key, n: self.log.append(("alloc", key, n)),
            on_free=lambda key: self.log.append(("free", key, None)),
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.watcher.observe(func, out)
        return out


@pytest.fixture
def watch() -> Callable[[], WatchMode]:
    return WatchMode


class Block(nn.Module):
    """Linear(d, h) -> GELU -> Linear(h, d) with a residual connection."""

    def __init__(self, d: int = 256, h: int = 1024) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class ResidualMLP(nn.Module):
    """``n`` blocks; ``wrap(block, x)`` runs each one (plain call, or a checkpoint)."""

    def __init__(self, n: int = 6, d: int = 256, h: int = 1024) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda b, x: b(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.wrap(block, x)
        return x


def build_mlp(seed: int = 0, **sizes: Any) -> ResidualMLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ResidualMLP(**sizes)


@pytest.fixture(scope="session")
def residual_mlp() -> Callable[..., ResidualMLP]:
    return build_mlp


@pytest.fixture(scope="session")
def counter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled counter library (skips without a C compiler or off Linux)."""
    lib = build_counter(tmp_path_factory.mktemp("malloc_counter"))
    if lib is None:
        pytest.skip("the malloc counter needs a C compiler and glibc")
    return lib


@pytest.fixture(scope="session")
def run_counted(counter: Path) -> Callable[[str, Any], Any]:
    """``run_counted(source, arg)``: run ``source`` under the counter with ``sys.argv[1]``
    the JSON of ``arg``; returns the JSON of the last line it printed."""

    def run(source: str, arg: Any) -> Any:
        try:
            return counted_child(counter, source, arg)
        except RuntimeError as e:
            pytest.fail(str(e))

    return run
