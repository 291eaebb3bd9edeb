"""Moved to :mod:`gradckpt.compiled.knapsack`: this old path warns and goes away in the next release.

The compiled path is one package now (:mod:`gradckpt.compiled`); it was never an
integration with another library. Every name, private ones included, is the new
module's own object.
"""

import warnings

from gradckpt.compiled import knapsack as _moved

__all__ = _moved.__all__  # served by __getattr__ below

warnings.warn(
    "gradckpt.integrations.compiled_knapsack moved to gradckpt.compiled.knapsack; import it from there "
    "(the old path goes away in the next release)",
    DeprecationWarning,
    stacklevel=2,  # the importer's line (warnings skips importlib's own frames)
)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)  # private names too: callers of the old path used some
