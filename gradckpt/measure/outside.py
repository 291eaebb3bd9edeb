"""Memory a CPU kernel takes from malloc without telling torch's allocator.

oneDNN's own buffers (the per-thread packing buffers of its GEMM driver, which
a dilated convolution's backward takes: ~0.7-4.4 MiB per call on a 2-core
machine, growing with threads) come from ``posix_memalign`` directly: no
allocator event, so :class:`~gradckpt.measure.MemoryEvents` cannot see them and
a plan that holds its budget at the allocator runs over it at malloc level.

glibc has no in-process malloc hook any more (removed in 2.34), so an op's
malloc-level peak is read from the kernel's resident-set high-water mark:

* ``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` (and the trim threshold at twice
  that): a new block above it is its own mapping, returned to the kernel when
  freed, so resident memory follows the live blocks;
* the heap's free chunks of 64 KiB or more, which earlier work left (glibc's
  threshold had risen, so its large blocks came from the heap), are trimmed and
  held for the pass (:mod:`gradckpt.measure.free_chunks`): glibc serves a large
  request from a free chunk that fits before it maps one, so without this a
  block could reuse resident pages unseen, and a trimmed chunk split for small
  requests faults in pages malloc does not count. Held chunks have no resident
  page, but malloc counts them: after a few steps they can add up to the step's
  own peak (47.6 MiB beside a 32.2 MiB ResNet step), so under
  :func:`held_at_most` (what a byte budget leaves beside the profiled step) the
  largest are held up to that many bytes, and the rest are left free;
* before each op ``malloc_trim(0)`` returns free heap pages, so a block that
  reuses a free chunk faults its pages in again and is seen;
* ``mallopt(M_PERTURB, ...)``: glibc fills each new block, so a buffer that
  is allocated but only partly written is resident in full (malloc counts it
  in full, and so must we);
* per op, ``5`` written to ``/proc/self/clear_refs`` resets ``VmHWM``; after
  the op ``VmHWM`` minus the resident bytes before it is the op's peak growth.

The kernel keeps resident counts per CPU and folds them in batches, and some
page reuse is not malloc's, so a first run's growth under :func:`noise_bytes`
(1 MiB on 2 CPUs) is ignored. A call that grew beyond its outputs by more than
:func:`settled_noise_bytes` (512 KiB) is run again (:func:`replay_growth`):
twice after a trim, then once without (the settled run, which reads no page
malloc's own writes fault in); growth the settled run shows above 512 KiB is
counted too. On the atrous model, with the preloaded malloc counter as the
truth: the dilated convolution's buffer (1.18 MiB) reads 0.96-1.17 MiB and is
counted in each of 12 profiles, where no other call read over 0.05 MiB.
The settings are restored on exit (the mmap threshold to 32 MiB,
glibc's own upper value for it, or ``MALLOC_MMAP_THRESHOLD_`` when set: glibc
cannot give back its earlier dynamic value). Without Linux, glibc or a
writable ``/proc/self/clear_refs`` there is no probe (:func:`unavailable`
says why) and profiles keep the allocator-level workspace; the same with
``GRADCKPT_OUTSIDE_PROBE=0`` in the environment (:func:`switched_off`).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from gradckpt.measure.free_chunks import hold_free_chunks, release

__all__ = [
    "REPLAYS", "SWITCH", "RssProbe", "held_at_most", "needs_replay", "noise_bytes",
    "replay_growth", "rss_probe", "settled_noise_bytes", "suspended", "switched_off",
    "unavailable",
]  # fmt: skip

#: The environment variable that turns the probe off (see :func:`switched_off`).
SWITCH = "GRADCKPT_OUTSIDE_PROBE"

#: Extra runs, each after a trim, of a call that grew beyond its outputs: a kernel's
#: threads take their buffers at once or in turn as they happen to run, and a budget
#: needs the worst. One settled run (no trim) follows them (:func:`replay_growth`).
REPLAYS = 2

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_PERTURB = -6
_SMALL_MMAP = 64 << 10
_GLIBC_MMAP_MAX = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
_PERTURB_BYTE = 0x5A


#: Bytes of free heap chunks a probed pass may hold (None: all of them).
_MOST_HELD: contextvars.ContextVar[int | None] = contextvars.ContextVar("most_held", default=None)


@contextlib.contextmanager
def held_at_most(nbytes: int | None) -> Iterator[None]:
    """Probed passes inside hold at most ``nbytes`` of free heap chunks (None: no bound).

    The caller knows the budget and the step's predicted peak; the probe knows
    neither. A bound leaves some free chunks reusable, so a block may reuse a
    resident page unseen on a run without a trim: the price of not holding more
    than the budget has room for.

    Example:
        >>> with held_at_most(4 << 20):
        ...     prof = gradckpt.profile(model, loss_fn)
    """
    token = _MOST_HELD.set(None if nbytes is None else max(0, int(nbytes)))
    try:
        yield
    finally:
        _MOST_HELD.reset(token)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc, not musl or another libc
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def switched_off() -> bool:
    """Whether the user turned the probe off: ``GRADCKPT_OUTSIDE_PROBE=0`` (or ``off``,
    ``false``, ``no``) in the environment, read at each profile.

    Off, a CPU profile keeps the allocator's workspace (as without glibc): no
    ``mallopt`` settings for the pass, no ``malloc_trim`` and ``clear_refs`` per op,
    no replays of ops that grew. For a process whose own malloc tuning must not be
    touched, or to compare a profile with and without the probe.

    Example:
        >>> switched_off()  # run with GRADCKPT_OUTSIDE_PROBE=0
        True
    """
    return os.environ.get(SWITCH, "").strip().lower() in ("0", "off", "false", "no")


_SUSPENDED: contextvars.ContextVar[bool] = contextvars.ContextVar("probe_suspended", default=False)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No probe for the profiles made inside: for callers that take only op times from
    them (``gradckpt.tune``'s real sizes), whose memory the probe's held chunks and
    replays would only add to.

    Example:
        >>> with suspended():
        ...     times = gradckpt.profile(model, loss_fn).step_time
    """
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


def unavailable() -> str:
    """Why the probe does not run in this process ("" when it does).

    Example:
        >>> unavailable()  # on Linux with glibc, the switch on
        ''
    """
    if switched_off():
        return f"switched off ({SWITCH}={os.environ[SWITCH]})"
    if _SUSPENDED.get():
        return "suspended by the caller (only op times are wanted)"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if _libc() is None:
        return "the C library is not glibc"
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return "/proc/self/clear_refs is not writable"
    return ""


@functools.cache  # asked per op in the profiling pass; the machine does not change
def noise_bytes() -> int:
    """Resident growth beyond the allocator's that is not taken as an op's own.

    The high-water mark is a snapshot of the kernel's running count, in which
    each CPU may hold up to ``max(32, 2 * cpus)`` pages not yet folded in
    (``percpu_counter_batch``): that much is counting noise. Page reuse that
    malloc does not count adds more: on 2 CPUs (a 256 KiB bound) a tiny ResNet's
    convolutions, with nothing outside the allocator by malloc's count, read up
    to 0.87 MiB of growth, one run in three. The floor is four times the bound.
    """
    return 4 * _count_lag_bytes()


@functools.cache
def settled_noise_bytes() -> int:
    """The floor for a settled reading (:func:`replay_growth`): twice the count lag.

    A settled run reads no page malloc's own bookkeeping faults in after a trim, so
    only the kernel's count lag (:func:`noise_bytes`' bound, 256 KiB on 2 CPUs) is
    left; twice that is 512 KiB on 2 CPUs.

    Example:
        >>> settled_noise_bytes() < noise_bytes()
        True
    """
    return 2 * _count_lag_bytes()


def _count_lag_bytes() -> int:
    # percpu_counter_batch pages per CPU, not yet folded into the resident count
    cpus = os.cpu_count() or 1
    return cpus * max(32, 2 * cpus) * os.sysconf("SC_PAGE_SIZE")


class RssProbe:
    """Peak resident growth of a stretch of code: ``start()`` before, ``stop(t)`` after."""

    def __init__(self, libc: ctypes.CDLL, status_fd: int, clear_fd: int) -> None:
        self._libc = libc
        self._status = status_fd
        self._clear = clear_fd

    def _read(self) -> tuple[int, int]:
        text = os.pread(self._status, 8192, 0)
        return _field(text, b"VmHWM:"), _field(text, b"VmRSS:")

    def start(self, trim: bool = True) -> int:
        """Reset the high-water mark; returns the resident bytes now.

        With ``trim`` free heap pages go back to the kernel first, so no block in
        the stretch reuses a resident page unseen (a thread arena's top, a freed
        chunk mid-heap); without it, malloc's own writes into free chunks (headers
        and the remainders of split chunks) fault in no page either.
        """
        if trim:
            self._libc.malloc_trim(0)
        os.write(self._clear, b"5")
        return self._read()[1]

    def stop(self, before: int) -> int:
        """Peak resident bytes since ``start`` above ``before``."""
        hwm, rss = self._read()
        return max(hwm, rss) - before


def needs_replay(func: Any, grown: int, out: Any) -> bool:
    """Whether a call that grew ``grown`` bytes and returned ``out`` is run again
    (:func:`replay_growth`): it grew beyond its outputs' bytes by more than the settled
    floor (:func:`settled_noise_bytes`), writes no argument and draws no random numbers.
    The floor is the settled replay's, not the first run's: a dilated convolution's
    1.2 MiB buffer first read 1.0-1.17 MiB, and under a 1 MiB trigger it went
    unreplayed, so unseen, in 3 profiles of 6.

    Example:
        >>> needs_replay(torch.ops.aten.mm.default, 0, None)  # no growth: no replay
        False
    """
    noise = settled_noise_bytes()
    if grown <= noise:  # most ops; the outputs, subtracted, could only lower it: not counted
        return False
    return grown - _output_bytes(out) > noise and _replayable(func)


def _output_bytes(out: Any) -> int:
    return sum(
        t.untyped_storage().nbytes()
        for t in tree_flatten(out)[0]
        if isinstance(t, torch.Tensor) and t.layout == torch.strided
    )


def replay_growth(probe: RssProbe, func: Any, args: tuple, kwargs: dict) -> tuple[int, int]:
    """``(worst, settled)``: the most ``func(*args, **kwargs)`` grew over :data:`REPLAYS`
    more runs, each after a trim, and then over one run without the trim.

    A trimmed run can read pages malloc's own writes into trimmed free chunks fault
    in (up to ~2 MiB on a dilated convolution's backward, malloc counting 0.05 MiB,
    before the large free chunks were held; a few pages since);
    the settled run, after them, reads no such page, but misses a block that reuses
    a free chunk the runs before left resident. So the worst is an upper reading
    and the settled one a lower one: growth a settled run shows above
    :func:`settled_noise_bytes` is the kernel's own.
    """
    worst = 0
    for _ in range(REPLAYS):
        worst = max(worst, _grown(probe, func, args, kwargs, trim=True))
    settled = _grown(probe, func, args, kwargs, trim=False)
    return max(worst, settled), settled


def _grown(probe: RssProbe, func: Any, args: tuple, kwargs: dict, *, trim: bool) -> int:
    before = probe.start(trim)
    func(*args, **kwargs)  # its outputs are dropped here, inside the stretch
    return probe.stop(before)


def _replayable(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    tags = getattr(func, "tags", ())
    return (
        schema is not None
        and not schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in tags
    )


def _field(text: bytes, name: bytes) -> int:
    at = text.index(name) + len(name)
    return int(text[at : text.index(b"kB", at)]) * 1024


def _restored_threshold() -> int:
    env = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(env) if env.isdigit() else _GLIBC_MMAP_MAX


@contextlib.contextmanager
def rss_probe() -> Iterator[RssProbe | None]:
    """A :class:`RssProbe` with glibc set up for it (None when :func:`unavailable`)."""
    if unavailable():
        yield None
        return
    libc = _libc()
    assert libc is not None
    status = os.open("/proc/self/status", os.O_RDONLY)
    clear = os.open("/proc/self/clear_refs", os.O_WRONLY)
    libc.mallopt(_M_MMAP_THRESHOLD, _SMALL_MMAP)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * _SMALL_MMAP)
    libc.malloc_trim(0)
    held = hold_free_chunks(libc, _SMALL_MMAP, _MOST_HELD.get())  # before perturb: no page in
    libc.mallopt(_M_PERTURB, _PERTURB_BYTE)
    try:
        yield RssProbe(libc, status, clear)
    finally:
        libc.mallopt(_M_PERTURB, 0)
        release(libc, held)
        threshold = _restored_threshold()
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold)  # the pairing glibc's dynamic rule keeps
        os.close(status)
        os.close(clear)
