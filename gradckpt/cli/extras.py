"""Optional extras (rich, matplotlib, transformers): imported late, reported clearly when missing.

``GRADCKPT_HIDE_EXTRAS=rich,matplotlib`` makes gradckpt act as if those were not
installed (for tests and for checking the plain-text output).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["EXTRA_OF", "CliError", "optional", "require"]

#: The pip extra that brings each optional module.
EXTRA_OF = {"rich": "cli", "matplotlib": "plot", "transformers": "hf"}


class CliError(Exception):
    """A problem with the user's input: one line on stderr, exit status 2."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _hidden() -> set[str]:
    return {n.strip() for n in os.environ.get("GRADCKPT_HIDE_EXTRAS", "").split(",") if n.strip()}


def optional(name: str) -> ModuleType | None:
    """The module ``name`` if it is installed (and not hidden), else None."""
    if name.split(".")[0] in _hidden():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def require(name: str, what: str) -> ModuleType:
    """The module ``name``, or a :class:`CliError` naming the extra to install."""
    module = optional(name)
    if module is None:
        extra = EXTRA_OF.get(name.split(".")[0], name)
        raise CliError(f"{what} needs {name.split('.')[0]}: pip install 'gradckpt[{extra}]'")
    return module
