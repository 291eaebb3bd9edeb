"""``Plan.token_chunks`` in plan files and summaries: MLPs run in slices of tokens.

A plan lists the token-wise modules it runs in slices as ``(module path, k)``
pairs beside its units' decisions (what they do:
:mod:`gradckpt.planning.kinds.chunk.token_plan`). A plan file writes them as
``"token_chunks": [[path, k], ...]`` and only when there are some (version 2);
the summary says so in plain words.

Example:
    >>> token_chunks_from_json([["layers.0.mlp", 4]], None)
    (('layers.0.mlp', 4),)
"""

from __future__ import annotations

from typing import Any

from gradckpt.planning.plans.errors import PlanFormatError

__all__ = ["token_chunk_lines", "token_chunks_from_json"]


def token_chunks_from_json(value: Any, source: str | None) -> tuple[tuple[str, int], ...]:
    """The pairs a plan file's ``token_chunks`` holds; :class:`PlanFormatError` if malformed."""
    try:
        return tuple((str(path), int(k)) for path, k in value)
    except (TypeError, ValueError) as e:
        raise PlanFormatError(
            f"{source + ': ' if source else ''}malformed gradckpt plan: token_chunks: {e}"
        ) from None


def token_chunk_lines(plan: Any) -> list[str]:
    """The summary's lines for a plan's MLPs in slices ([] when it has none).

    Example:
        >>> token_chunk_lines(plan)[0]
        'token-wise chunking: 2 MLP(s) in 4 slices of tokens, ...'
    """
    if not plan.token_chunks:
        return []
    ks = sorted({k for _, k in plan.token_chunks})
    return [
        f"  token-wise chunking: {len(plan.token_chunks)} MLP(s) in {'/'.join(map(str, ks))} "
        "slices of tokens, each slice recomputed in backward (exact up to the order of sums)",
        *(f"  {path:<28} mlp chunk  {k} slices of tokens" for path, k in plan.token_chunks),
    ]
