"""A token-wise module (an MLP) run in slices of tokens: the forward a plan installs on it.

:class:`TokenChunkedForward` replaces the module's ``forward``: its one input
``(..., width)`` is flattened to rows (tokens), cut into ``chunks`` near-equal
slices, and each slice runs the module's own forward as a checkpointed region of
the engine (:func:`~gradckpt.engine.chunking.slices.chunked_cat`); the results
are concatenated and take the input's leading shape again. Only one slice's
hidden activation lives at a time, in the forward and when backward recomputes
it. Inside an enclosing region's forward (a recomputed block) the slices run
plainly and are recomputed by that region; in its recompute each slice is a
nested region again, opened without running when the chunk is ``deferrable``
(it draws no random numbers) and holds that recompute's last saved tensor.
Without gradients, or when called otherwise than with one tensor, it is the
plain forward.

The planner installs it only on modules it proved token-wise on the profile
(:mod:`gradckpt.planning.kinds.chunk.token_wise`). Results equal the plain
module's up to the order of floating-point sums in the weights' gradients.

Example:
    >>> mlp.forward = TokenChunkedForward(mlp.forward, 8, name="layers.0.mlp")
    >>> y = mlp(x)  # (B, T, H): 8 slices of B*T/8 tokens
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradckpt.engine.chunking.slices import chunked_cat

__all__ = ["TokenChunkedForward"]


class TokenChunkedForward:
    """``plain`` run on ``chunks`` slices of the tokens of its one input; see the module docstring."""

    #: (what a forward pickled before this attribute existed reads)
    deferrable = False

    def __init__(
        self, plain: Callable[..., Any], chunks: int, name: str = "", deferrable: bool = False
    ) -> None:
        self.plain, self.chunks, self.name = plain, int(chunks), name
        # Draws no random numbers (the planner proved it): an enclosing region's
        # recompute opens the slices without running them (engine.chunking.slices).
        self.deferrable = deferrable
        self.active = True  # False once removed while another wrapper still calls this one
        self.root: Any = None  # apply sets the model's guard on every wrapper it installs

    @property
    def __gradckpt_original__(self) -> Callable[..., Any]:
        return self.plain

    def _rows(self, part: torch.Tensor) -> torch.Tensor:
        out = self.plain(part)
        return out.reshape(part.shape[0], -1)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if len(args) == 1 and not kwargs else None
        if (
            not self.active or not isinstance(x, torch.Tensor) or x.dim() < 2
            or not torch.is_grad_enabled() or self.chunks < 2
        ):  # fmt: skip
            return self.plain(*args, **kwargs)
        rows = x.reshape(-1, x.shape[-1])
        out = chunked_cat(self._rows, self.chunks, rows, name=self.name, deferrable=self.deferrable)
        return out.view(*x.shape[:-1], out.shape[-1])
