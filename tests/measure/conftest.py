"""Shared helpers for the measurement tests: a bare watcher mode, the residual MLP,
and a malloc-level counter preloaded into a child interpreter.

The counter is a tiny C library: it wraps glibc's malloc family and keeps the
live and peak bytes (by ``malloc_usable_size``); the child reads them through
``ctypes.CDLL(None)``: ``gck_current()``, ``gck_peak()``, ``gck_reset_peak()``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradckpt.measure import StorageWatcher


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


COUNTER_C = r"""
#define _GNU_SOURCE
#include <stddef.h>
#include <malloc.h>
#include <errno.h>
extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static long long current_bytes = 0, peak_bytes = 0;
static void add(long long n) {
  long long now = __atomic_add_fetch(&current_bytes, n, __ATOMIC_RELAXED);
  long long seen = __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED);
  while (now > seen && !__atomic_compare_exchange_n(&peak_bytes, &seen, now, 1,
                                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}
static void *note(void *p) { if (p) add((long long)malloc_usable_size(p)); return p; }
void *malloc(size_t n) { return note(__libc_malloc(n)); }
void free(void *p) { if (p) { add(-(long long)malloc_usable_size(p)); __libc_free(p); } }
void *calloc(size_t a, size_t b) { return note(__libc_calloc(a, b)); }
void *realloc(void *p, size_t n) {
  if (p) add(-(long long)malloc_usable_size(p));
  return note(__libc_realloc(p, n));
}
void *memalign(size_t a, size_t n) { return note(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return note(__libc_memalign(a, n)); }
void *valloc(size_t n) { return note(__libc_memalign(4096, n)); }
int posix_memalign(void **out, size_t a, size_t n) {
  void *p = __libc_memalign(a, n);
  if (!p) return ENOMEM;
  *out = note(p);
  return 0;
}
long long gck_current(void) { return current_bytes; }
long long gck_peak(void) { return peak_bytes; }
void gck_reset_peak(void) {
  __atomic_store_n(&peak_bytes, __atomic_load_n(&current_bytes, __ATOMIC_RELAXED),
                   __ATOMIC_RELAXED);
}
"""


@pytest.fixture(scope="session")
def counter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled counter library (skips without a C compiler or off Linux)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        pytest.skip("the malloc counter needs a C compiler and glibc")
    where = tmp_path_factory.mktemp("malloc_counter")
    (where / "counter.c").write_text(COUNTER_C)
    lib = where / "libcounter.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(where / "counter.c")],
                   check=True)  # fmt: skip
    return lib


@pytest.fixture(scope="session")
def run_counted(counter: Path) -> Callable[[str, Any], Any]:
    """``run_counted(source, arg)``: run ``source`` under the counter with ``sys.argv[1]``
    the JSON of ``arg``; returns the JSON of the last line it printed."""

    def run(source: str, arg: Any) -> Any:
        env = {**os.environ, "LD_PRELOAD": str(counter), "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(
            [sys.executable, "-c", source, json.dumps(arg)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run
