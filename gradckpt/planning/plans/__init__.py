"""The plan as data: its items and decisions, its file format, its summary, plan sets.

:mod:`.plan` (``Plan``, ``UnitChoice``, ``Segment``), :mod:`.errors` (what a
malformed plan file is told), :mod:`.offload_options` and :mod:`.step_parts`
(parts a plan carries), :mod:`.call_key` (the key of a model call's shape) and
:mod:`.planset` (plans keyed by it). Below the simulator and the solvers; above
only the kind registry (:mod:`gradckpt.planning.handlers`), which the summary asks
how a decision reads.
"""
