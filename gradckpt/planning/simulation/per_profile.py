"""``@per_profile``: a function of a profile computed once per profile object.

The solver simulates dozens of plans of one profile and reads the same
indexes of it each time (events no plan changes, packs by unit). Profiles are
frozen, so what is derived from one stays valid while it lives; hashing a
profile would walk all its records, so results are kept by the object's
identity and dropped when it is collected.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TypeVar

from gradckpt.profiling.records import Profile

__all__ = ["per_profile"]

T = TypeVar("T")


def per_profile(fn: Callable[[Profile], T]) -> Callable[[Profile], T]:
    """Cache ``fn(profile)`` per profile object, for as long as the profile lives.

    Example:
        >>> @per_profile
        ... def op_count(profile): return len(profile.ops)
    """
    results: dict[int, tuple[weakref.ref, T]] = {}

    @functools.wraps(fn)
    def cached(profile: Profile) -> T:
        key = id(profile)
        entry = results.get(key)
        if entry is not None and entry[0]() is profile:
            return entry[1]
        value = fn(profile)
        results[key] = (weakref.ref(profile, lambda _, key=key: results.pop(key, None)), value)
        return value

    return cached
