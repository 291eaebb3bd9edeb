"""One process-wide lock for what torch cannot do from two threads at once.

Torch's profiler is one per process: two :class:`~gradckpt.measure.MemoryEvents`
sessions started from two threads corrupt each other's state and crash the
process (SIGSEGV inside kineto). A profiled step also resets and restores the
global RNG between its passes. So :func:`gradckpt.profile` holds
:data:`MEASURING` for its whole run and every ``MemoryEvents`` session (the
allocator tracker, the frugal check of ``fit``) holds it while open: two models
fitted at once in two threads take turns there, and the rest of their work
(solving, applying, training) runs in parallel. The lock is re-entrant, so
sessions nest within one thread as before.
"""

from __future__ import annotations

import threading

__all__ = ["MEASURING"]

#: Held while torch's profiler or a profiled step's RNG resets are in use.
MEASURING = threading.RLock()
