"""The decision kinds, one module each: what each does in the planner and at run time.

Each module defines one :class:`~gradckpt.planning.handlers.KindHandler` and
registers it; importing this package loads them all (the registry does so on
its first lookup). The order here is the order of a unit's options in the DP:
keep first, recompute second, then the rest.

Adding a kind: its Decision dataclass (registered with
:func:`~gradckpt.engine.decisions.decision_kind`, so plan files can name it),
one module here with its handler, one import line below, and its tests.
"""

from gradckpt.planning.kinds import keep, recompute, selective  # noqa: F401 - they register

__all__: list[str] = []
