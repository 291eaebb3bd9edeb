"""Layer 4 (profiling): measure one training step (ops, sizes, times, what backward keeps).

The verb is :func:`gradckpt.profile` (in :mod:`gradckpt.api`); this package is its machinery.
"""

from gradckpt.profiling.fingerprint import model_fingerprint
from gradckpt.profiling.records import (
    NEVER,
    OpRecord,
    PackRecord,
    Profile,
    StorageRecord,
    UnitRecord,
)
from gradckpt.profiling.run import ProfileError, profile
from gradckpt.profiling.units import Unit, find_blocks, find_units

__all__ = [
    "NEVER",
    "OpRecord",
    "PackRecord",
    "Profile",
    "ProfileError",
    "StorageRecord",
    "Unit",
    "UnitRecord",
    "find_blocks",
    "find_units",
    "model_fingerprint",
    "profile",
]
