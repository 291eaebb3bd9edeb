"""The decision kinds, one module each: what each does in the planner and at run time.

Each module defines one :class:`~gradckpt.planning.handlers.registry.KindHandler`
and registers it; :mod:`gradckpt.planning` imports this package, so the
built-in kinds are registered before anything asks the registry. The kinds sit
above the simulator and the solvers they plug into (those reach them only
through the registry), so a kind's module, and its own planning parts (as
``offload/`` has: its cost model, simulated effect and solver), may import
any of them. The order here is the order of a unit's options in the DP: keep
first, recompute second, then the rest.

Adding a kind: its Decision dataclass (registered with
:func:`~gradckpt.engine.decisions.decision_kind`, so plan files can name it),
one module here with its handler, one import line below, and its tests.
"""

# In this order (they register as imported): offload before selective, so that a
# block's offload option is its third (index 2) on every block and the chain's
# calibration runs one all-offload plan; the offloaded boundary (recompute_offload)
# fourth, for the same reason.
from gradckpt.planning.kinds import keep  # noqa: F401, I001
from gradckpt.planning.kinds import recompute  # noqa: F401
from gradckpt.planning.kinds.offload import handler  # noqa: F401
from gradckpt.planning.kinds.offload import boundary  # noqa: F401
from gradckpt.planning.kinds import selective  # noqa: F401
from gradckpt.planning.kinds.chunk import handler as chunk  # noqa: F401  (last: the head's options after recompute)
from gradckpt.planning.kinds.chunk import token_plan  # noqa: F401  (MLPs in slices: a plan part)

__all__: list[str] = []
