"""Hold the heap's large free chunks for a probed pass (``gradckpt.measure.outside``).

A step run before the probe leaves large free chunks mid-heap (glibc's mmap
threshold rises to 32 MiB as mmapped blocks are freed, so big blocks came from
the heap). Under the probe, a large request is served from such a chunk when one
fits, before any mmap: its pages are resident unless a trim just released them,
and a trimmed chunk split for small requests faults in pages malloc does not
count. On the atrous model profiled after four plain steps, a dilated
convolution's 1.2 MiB buffer then read 0 on a run without a trim, while forward
convolutions read 1.0 MiB that malloc never counted.

So the chunks are taken for the pass: after a trim they hold no resident page,
and the pass's large requests are fresh mmaps, seen in full. Only the calling
thread's arena is plugged (the one a single-threaded kernel allocates from).
"""

from __future__ import annotations

import ctypes

from gradckpt.measure.beside import mall_info

__all__ = ["MOST_HELD", "hold_free_chunks", "release"]

#: At most this many chunks are held: each try asks ``mallinfo2``, which walks the
#: free lists, so a heap in very many pieces would cost quadratic time (the atrous
#: model's heap after four plain steps: 19-31 chunks, 0.6 ms).
MOST_HELD = 4096


def hold_free_chunks(libc: ctypes.CDLL, smallest: int, most_bytes: int | None = None) -> list[int]:
    """Allocate every free heap chunk of ``smallest`` bytes or more (call after a trim,
    with the mmap threshold at ``smallest``, before ``M_PERTURB``); returns the blocks.

    A request the heap cannot serve is mmapped (mapped, never written) and freed
    at once; the request size halves until it is under ``smallest``. With
    ``most_bytes``, at most that many bytes are held, the largest chunks first:
    held blocks are trimmed (no resident page), but malloc counts them, and a
    budget counted at malloc's level has to hold them (:func:`gradckpt.measure.outside.held_at_most`).
    """
    info = mall_info(libc)
    if info is None:
        return []
    malloc, free = libc.malloc, libc.free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    held: list[int] = []
    left = info.fordblks if most_bytes is None else max(0, most_bytes)
    size = min(info.fordblks, left)
    while size >= smallest and len(held) < MOST_HELD:
        mapped = info.hblkhd
        block = malloc(size)
        info = mall_info(libc)
        assert info is not None
        if block and info.hblkhd == mapped:  # from the heap: hold it, try the size again
            held.append(block)
            left -= size
            size = min(size, left)
            continue
        if block:
            free(block)
            info = mall_info(libc)
            assert info is not None
        size //= 2
    return held


def release(libc: ctypes.CDLL, held: list[int]) -> None:
    """Free what :func:`hold_free_chunks` took (with ``M_PERTURB`` off: no page written)."""
    for block in held:
        libc.free(block)
