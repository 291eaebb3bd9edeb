"""``explain``: what a plan keeps for backward, why, and where the peak is.

:mod:`.explain` computes an :class:`~.explanation.Explanation` from the
simulator's regions and prediction (and, for offloaded units, the offload
kind's own view, :mod:`gradckpt.planning.kinds.offload.sim`).
"""
