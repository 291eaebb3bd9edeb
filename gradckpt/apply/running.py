"""Whether a module's call is already running: planning from inside a forward.

A trainer callback or a forward pre-hook may call ``gradckpt.fit`` while the
model's own call has begun: ``nn.Module.__call__`` picked the model's
``forward`` before running the pre-hooks, so the root wrapper ``fit`` installs
(where a plan's segments open) does not run for that call; its units' wrappers
do, since each unit is looked up when it is called. ``fit`` asks
:func:`call_running` and gives such a call a plan it can run (no segments); the
plan it made takes over at the next step (:mod:`gradckpt.apply.guard_routing`).

Example:
    >>> def hook(module, args):
    ...     assert call_running(module)
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["call_running"]

_CALL_CODES = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}


def call_running(module: nn.Module) -> bool:
    """Whether a call of ``module`` is on this thread's Python stack (its hooks or forward).

    Example:
        >>> call_running(model)  # False outside the model's forward
        False
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALL_CODES and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False
