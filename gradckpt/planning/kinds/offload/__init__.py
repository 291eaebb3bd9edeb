"""The ``Offload`` kind: its handler and every planning part of its own.

:mod:`.handler` (the ``OffloadHandler``, registered), :mod:`.boundary` (the
``RecomputeOffload`` kind's handler, registered: a recomputed unit's kept input
offloaded), :mod:`.cost` (transfers,
overlap, the copy queue as pure functions), :mod:`.sim` (its plan-wide effect in
the simulator: stash, reload buffers, stalls) and :mod:`.solve` (the DP with a
host budget: a price on host bytes). Its options are plan data
(:mod:`gradckpt.planning.plans.offload_options`); its engine is
:mod:`gradckpt.engine.offload`.
"""
