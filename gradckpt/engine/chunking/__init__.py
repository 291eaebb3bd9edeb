"""Chunked execution: token-wise work in slices, each a checkpointed region.

The mechanism behind the ``Chunk`` decision: :func:`chunked_sum` and
:func:`chunked_cat` run a token-wise function slice by slice;
:func:`chunked_cross_entropy` is the head and the loss so run;
:class:`LazyLogits` is what a chunked head returns, so a loss written as
``F.cross_entropy(model(x).view(-1, V), y)`` runs chunked unchanged.
"""

from gradckpt.engine.chunking.cross_entropy import chunked_cross_entropy
from gradckpt.engine.chunking.linear_loss import LinearHead
from gradckpt.engine.chunking.slices import chunked_cat, chunked_sum, token_slices

__all__ = ["LinearHead", "chunked_cat", "chunked_cross_entropy", "chunked_sum", "token_slices"]
