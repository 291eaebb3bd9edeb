"""The decision kinds, one module each: what each does in the planner and at run time.

Each module defines one :class:`~gradckpt.planning.handlers.KindHandler` and
registers it; importing this package loads them all (the registry does so on
its first lookup). The order here is the order of a unit's options in the DP:
keep first, recompute second, then the rest.

Adding a kind: its Decision dataclass (registered with
:func:`~gradckpt.engine.decisions.decision_kind`, so plan files can name it),
one module here with its handler, one import line below, and its tests.
"""

# In this order (they register as imported): offload before selective, so that a
# block's offload option is its third (index 2) on every block and the chain's
# calibration runs one all-offload plan.
from gradckpt.planning.kinds import keep  # noqa: F401, I001
from gradckpt.planning.kinds import recompute  # noqa: F401
from gradckpt.planning.kinds import offload  # noqa: F401
from gradckpt.planning.kinds import selective  # noqa: F401

__all__: list[str] = []
