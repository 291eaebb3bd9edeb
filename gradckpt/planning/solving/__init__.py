"""Choosing plans: the chain model and its DP, the baselines, the solvers.

:mod:`.chain` turns a profile into the DP's chain (calibrated on the
simulator), :mod:`.dp` solves it (:mod:`.dp_cells` fills the tables), and
:mod:`.solvers` holds ``SOLVERS`` and the DP solver; :mod:`.baselines`,
:mod:`.whole_unit`, :mod:`.polish`, :mod:`.whole_step` (the training step
folded into a profile), :mod:`.rescale` (profiles at other lengths) and
:mod:`.budget` (what a budget means) serve them. Plans leave through
:func:`gradckpt.planning.solve.solve`, above the kinds.
"""
