"""One warning per model and subject, pointed at the user's own call.

Fitting, re-planning or enabling the same transformers model again says
nothing new; the warning names the first frame outside gradckpt.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref

from torch import nn

_told: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def tell_once(model: nn.Module, key: str, message: str) -> None:
    """Warn ``message`` unless ``model`` was already told about ``key``.

    Example:
        >>> tell_once(model, "fit", "gradckpt.fit on GPT2LMHeadModel: set use_cache=False.")
    """
    said = _told.setdefault(model, set())
    if key not in said:
        said.add(key)
        warnings.warn(message, UserWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The warning stack level of the first frame outside gradckpt (the user's call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gradckpt/
    frame, level = sys._getframe(1), 1  # level 1: tell_once, which calls warnings.warn
    while frame is not None and (
        frame.f_code.co_filename.startswith(package)
        or frame.f_code.co_filename == contextlib.__file__
    ):
        frame, level = frame.f_back, level + 1
    return level
