"""``Selective``: a region that keeps the outputs of some of its ops (a per-op policy).

The DP's selective options are the unit's candidate save sets (matmul outputs,
and the cheapest bytes that remove 25/50/75% of its recompute time, see
:func:`candidate_sets`, here: the kind's planning part). At run time the region's policy
keeps the planned op positions and checks that the op there is the planned one.
"""

from __future__ import annotations

import warnings
from typing import Any

from gradckpt.engine.decisions import RECOMPUTE, SAVE, Decision, PolicyContext, Selective
from gradckpt.planning.handlers.lookup import Lookup, recompute_end
from gradckpt.planning.handlers.registry import register
from gradckpt.planning.kinds.recompute import RecomputeHandler
from gradckpt.policies import MATMUL_OPS
from gradckpt.profiling.records import Profile, UnitRecord

__all__ = ["PlanPolicy", "SelectiveHandler", "candidate_sets"]

_MATMUL_NAMES = {str(op) for op in MATMUL_OPS}
_TIME_SHARES = (0.25, 0.5, 0.75)


def candidate_sets(
    profile: Profile, unit: UnitRecord, look: Lookup | None = None
) -> list[Selective]:
    """Selective save sets for a block: matmul outputs, and the cheapest bytes that
    remove 25/50/75% of its recompute time (ops by time per byte, best first)."""
    stop = recompute_end(profile, unit, look)
    eligible = []
    for op in profile.ops[unit.first_op : stop]:
        if not op.outputs or op.time <= 0:
            continue
        storages = [profile.storages[s] for s in op.outputs]
        if any(s.mutated for s in storages):
            continue  # changed in place later: a kept copy would be stale
        eligible.append((op, sum(s.nbytes for s in storages)))
    if not eligible:
        return []
    sets: list[tuple[int, ...]] = []
    matmuls = tuple(op.local for op, _ in eligible if op.name in _MATMUL_NAMES)
    if matmuls:
        sets.append(matmuls)
    ranked = sorted(eligible, key=lambda e: e[0].time / max(e[1], 1), reverse=True)
    total = sum(op.time for op, _ in eligible)
    for share in _TIME_SHARES:
        chosen, acc = [], 0.0
        for op, _ in ranked:
            if acc >= share * total:
                break
            chosen.append(op.local)
            acc += op.time
        sets.append(tuple(sorted(chosen)))
    unique = list(dict.fromkeys(s for s in sets if s))
    ops = profile.unit_ops(unit)
    return [Selective(s, tuple(ops[i].name for i in s)) for s in unique]


class PlanPolicy:
    """Keep the ops at positions ``save``; warn (and recompute) if an op there is not the planned one.

    An object rather than a closure so an applied model can be pickled.
    """

    def __init__(self, path: str, save: tuple[int, ...], names: tuple[str, ...]) -> None:
        self.path = path
        self.expected = dict(zip(save, names))
        self.warned = False
        self.__name__ = f"plan_policy({path})"

    def __call__(self, ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        name = self.expected.get(ctx.index)
        if name is None:
            return RECOMPUTE
        if str(op) == name:
            return SAVE
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"gradckpt: op #{ctx.index} of {self.path} is {op}, but the plan expected "
                f"{name}; it is recomputed instead of kept. Was the model or its inputs "
                "changed since planning? Plan again to get the predicted memory.",
                stacklevel=2,
            )
        return RECOMPUTE


class SelectiveHandler(RecomputeHandler):
    """A region whose policy keeps the outputs of the ops at ``decision.save``."""

    decision = Selective
    asks_policy = True
    compiled_body = False  # its policy must see every op: the unit runs eagerly

    def kept_ops(self, unit: UnitRecord, decision: Decision) -> frozenset[int]:
        assert isinstance(decision, Selective)
        return frozenset(unit.first_op + i for i in decision.save)

    def stage_options(self, profile: Profile, unit: UnitRecord, look: Lookup) -> list[Decision]:
        return candidate_sets(profile, unit, look) if unit.is_block else []

    def option_name(self, decision: Decision, index: int) -> str:
        return f"selective{index - 1}"

    def policy(self, path: str, decision: Decision) -> PlanPolicy:
        assert isinstance(decision, Selective)
        return PlanPolicy(path, decision.save, decision.save_ops)

    def describe(self, decision: Decision) -> str:
        assert isinstance(decision, Selective)
        kept = ", ".join(n.replace("aten.", "") for n in decision.save_ops)
        return f"selective  keeps: {kept}"

    def explain(self, decision: Decision) -> str:
        assert isinstance(decision, Selective)
        n = len(decision.save)
        return f"selective (keeps {n} op output{'s' * (n != 1)})"


register(SelectiveHandler())
