"""Layer 4: measure one training step (ops, sizes, times, what backward keeps)."""

from gradckpt.profile.fingerprint import model_fingerprint
from gradckpt.profile.records import (
    NEVER,
    OpRecord,
    PackRecord,
    Profile,
    StorageRecord,
    UnitRecord,
)
from gradckpt.profile.run import ProfileError, profile
from gradckpt.profile.units import Unit, find_blocks, find_units

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

from gradckpt._callable import make_callable


def _profile_verb():
    from gradckpt.api import profile as profile_with_integrations

    return profile_with_integrations


make_callable(__name__, _profile_verb)
