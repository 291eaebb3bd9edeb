"""Python's ``random`` and NumPy's ``np.random`` streams, captured for a region cheaply.

A region replays these two global streams in its recompute (beyond torch's
checkpoint, see :mod:`gradckpt.engine.state`). Their full states are slow to
read: ``random.getstate()`` builds a 625-int tuple (~10 us), NumPy's
``get_state()`` copies its key array (~45 us); on short ops a region paid more
for them than torch pays for the whole region. Both generators are Mersenne
Twisters whose 624 words (plus a position) sit in one C struct, readable in
place in about a microsecond (:meth:`_Stream.words`). Every draw moves them,
except a normal draw that takes a Gaussian the generator cached earlier, so the
Gaussian cache is part of the mark (Python keeps it as an attribute) or makes
the words untrusted (NumPy's is not readable: then the full state is compared).

So a capture reads the words and reuses the full state read last time when the
words have not moved since (most regions draw nothing: one full read serves
every region of a step), and the check after the forward compares words. Where
the words cannot be read (another interpreter or NumPy layout), the full
states are read and compared, as before. A layout is trusted only after the
words read in place matched the full state read the slow way.

Example:
    >>> state, mark = PYTHON.capture()
    >>> random.random()
    >>> PYTHON.drew(state, mark)
    True
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Any

__all__ = ["NUMPY", "PYTHON", "numpy_random"]

_N = 624  # Mersenne Twister words


def numpy_random() -> Any:
    """``numpy.random`` if the program imported NumPy (gradckpt never imports it), else None."""
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


class _Stream:
    """One global host RNG: its full state (slow to read) and its raw words (fast)."""

    def __init__(self) -> None:
        self._memo: tuple[Any, Any] | None = None  # (mark, full state) of the last full read

    def get_state(self) -> Any:
        raise NotImplementedError

    def set_state(self, state: Any) -> None:
        raise NotImplementedError

    def words(self) -> Any:
        """The raw state read in place, or None where it cannot be."""
        raise NotImplementedError

    def mark_of(self, state: Any, words: Any) -> Any:
        """``words``, if they tell every draw after ``state`` was read; else None."""
        raise NotImplementedError

    def same(self, a: Any, b: Any) -> bool:
        return a == b

    def capture(self) -> tuple[Any, Any]:
        """The state now and its mark (None: the words cannot tell a draw)."""
        words = self.words()
        memo = self._memo
        if words is not None and memo is not None and memo[0] == words:
            return memo[1], words  # nothing drawn since the last full read
        state = self.get_state()
        mark = self.mark_of(state, words) if words is not None else None
        self._memo = (mark, state) if mark is not None else None
        return state, mark

    def drew(self, state: Any, mark: Any) -> bool:
        """Whether the stream moved since ``capture`` returned ``state, mark``."""
        if mark is not None:
            return self.words() != mark
        return not self.same(self.get_state(), state)


class _PythonStream(_Stream):
    """``random``'s module-level generator (a ``_random.Random``: index, then 624 words)."""

    def get_state(self) -> Any:
        return random.getstate()

    def set_state(self, state: Any) -> None:
        random.setstate(state)

    def words(self) -> Any:
        inst = random._inst
        # Read after the object header: the C struct's position and words.
        raw = ctypes.string_at(id(inst) + object.__basicsize__, 4 * (_N + 1))
        return raw, inst.gauss_next

    def mark_of(self, state: Any, words: Any) -> Any:
        _, internal, gauss = state
        if len(internal) != _N + 1 or sys.byteorder != "little":
            return None
        expected = struct.pack(f"<i{_N}I", internal[-1], *internal[:_N])
        return words if words == (expected, gauss) else None


#: Bytes of NumPy's Mersenne Twister state struct: 624 32-bit words and an int position.
_MT_STATE_BYTES = _N * 4 + 4


class _NumpyStream(_Stream):
    """NumPy's legacy global ``RandomState`` (``np.random.seed`` and friends)."""

    def get_state(self) -> Any:
        module = numpy_random()
        return module.get_state() if module is not None else None

    def set_state(self, state: Any) -> None:
        module = numpy_random()
        if module is not None:
            module.set_state(state)

    def words(self) -> Any:
        module = numpy_random()
        if module is None:
            return None
        try:
            address = module.mtrand._rand._bit_generator.ctypes.state_address
        except Exception:  # any other NumPy: the full state is read instead
            return None
        return ctypes.string_at(address, _MT_STATE_BYTES)

    def mark_of(self, state: Any, words: Any) -> Any:
        # Legacy state tuples: (name, key array, position, has_gauss, cached_gaussian).
        # With a Gaussian cached, a normal draw takes it and leaves the words alone.
        if state is None or len(state) != 5 or state[0] != "MT19937" or state[3]:
            return None
        expected = state[1].astype("<u4").tobytes() + int(state[2]).to_bytes(
            4, "little", signed=True
        )
        return words if sys.byteorder == "little" and words == expected else None

    def same(self, a: Any, b: Any) -> bool:
        if a is None or b is None or len(a) != len(b):
            return a is b
        if any(x != y for i, (x, y) in enumerate(zip(a, b)) if i != 1):
            return False
        return bool((a[1] == b[1]).all())


PYTHON = _PythonStream()
NUMPY = _NumpyStream()
