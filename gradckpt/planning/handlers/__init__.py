"""The decision-kind registry, and the values its hooks take and return.

The lowest part of the planner: :mod:`.registry` (``KindHandler``,
``register``, ``handler_for``) and the plain values a kind's hooks exchange
with the generic code (a simulator :class:`~.region.Region`, engine
:class:`~.engine_counts.EngineCounts`, a plan-wide
:class:`~.effects.StepEffect`, the chain builder's :class:`~.lookup.Lookup`).
They import nothing else of the planner, so every part of it can dispatch
through the registry; the kinds themselves (:mod:`gradckpt.planning.kinds`)
sit above the code that dispatches to them and register when
:mod:`gradckpt.planning` is imported.
"""
