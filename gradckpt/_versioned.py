"""The header every JSON document gradckpt writes carries: a kind and a version."""

from __future__ import annotations

from typing import Any

__all__ = ["check_header"]


def check_header(data: dict[str, Any], kind: str, version: int, redo: str) -> None:
    """Raise a ValueError unless ``data`` is a ``kind`` document of this ``version``.

    Example:
        >>> check_header({"kind": "gradckpt.Plan", "version": 1}, "gradckpt.Plan", 1, "plan again")
    """
    what = kind.replace(".", " ").lower()  # "gradckpt plan"
    if data.get("kind") != kind:
        raise ValueError(f"not a {what} (the JSON lacks kind: {kind})")
    if data.get("version") != version:
        raise ValueError(
            f"{what} version {data.get('version')} is not supported (this gradckpt reads "
            f"version {version}); {redo}"
        )
