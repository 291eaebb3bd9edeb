"""A malloc-level counter preloaded into a child interpreter: the truth budgets are held to.

A tiny C library wraps glibc's malloc family and keeps the live and peak bytes
(by ``malloc_usable_size``); a child started with it in ``LD_PRELOAD`` reads them
through ``ctypes.CDLL(None)``: ``gck_current()``, ``gck_peak()``,
``gck_reset_peak()``. Tests (``tests/measure/conftest.py``) and benchmarks
(``benchmarks/planning_memory.py``) build it here.

Example:
    >>> lib = build_counter(Path("/tmp/counter"))
    >>> run_counted(lib, "import json; print(json.dumps(1))", None)
    1
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["COUNTER_C", "build_counter", "run_counted"]

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


def build_counter(where: Path) -> Path | None:
    """Compile the counter into ``where`` (None without a C compiler or off Linux).

    Example:
        >>> build_counter(Path("/tmp/counter")).name
        'libcounter.so'
    """
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        return None
    where.mkdir(parents=True, exist_ok=True)
    (where / "counter.c").write_text(COUNTER_C)
    lib = where / "libcounter.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(where / "counter.c")],
                   check=True)  # fmt: skip
    return lib


def run_counted(lib: Path, source: str, arg: Any, env: dict[str, str] | None = None) -> Any:
    """Run ``source`` in a child under the counter, ``sys.argv[1]`` the JSON of ``arg``;
    returns the JSON of the last line it printed (RuntimeError with its stderr if it failed).

    Example:
        >>> run_counted(lib, "import json, sys; print(sys.argv[1])", [1, 2])
        [1, 2]
    """
    full = {**os.environ, **(env or {}), "LD_PRELOAD": str(lib),
            "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", source, json.dumps(arg)], env=full,
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"the counted child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
