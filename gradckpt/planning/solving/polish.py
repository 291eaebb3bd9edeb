"""Polish and repair a DP plan on the exact simulator.

The DP's memory model is exact for the plans it is calibrated on (all units
kept, every block in one option) and close for mixed ones, so at the margin of
a budget its plan may recompute a little more than needed, or land a little
over. Two greedy passes of single moves, each checked by simulation, fix that:

* :func:`polish` tries moves that save time — a unit back to ``keep`` or to a
  cheaper option, a segment dissolved into its items or into one region per
  unit — and keeps each that still fits;
* :func:`repair` tries moves that save memory and takes, each round, the one
  that lowers the peak most per second of extra recompute, until the plan fits.

Both simulate at most a fixed number of candidates, so planning time stays
bounded on deep models.
"""

from __future__ import annotations

from collections.abc import Iterator

from gradckpt.engine.decisions import RECOMPUTE
from gradckpt.planning.plans.plan import Item, Plan, Segment, UnitChoice
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.planning.solving.chain import ChainModel
from gradckpt.profiling.records import Profile

__all__ = ["polish", "repair"]

_POLISH_SIMULATIONS = 48
# A simulation costs about one pass over the profile's storages and saved tensors;
# past this many records the polish gets proportionally fewer simulations (at least
# _POLISH_FLOOR), so that planning time stays near linear in depth.
_POLISH_RECORDS = 240_000
_POLISH_FLOOR = 8
_REPAIR_ROUNDS = 8
_REPAIR_CANDIDATES = 12


def _replace(items: tuple[Item, ...], target: Item, new: tuple[Item, ...]) -> tuple[Item, ...]:
    out: list[Item] = []
    for item in items:
        if item is target:
            out.extend(new)
        elif isinstance(item, Segment):
            out.append(Segment(_replace(item.items, target, new)))
        else:
            out.append(item)
    return tuple(out)


def _walk(items: tuple[Item, ...]) -> Iterator[Item]:
    for item in items:
        yield item
        if isinstance(item, Segment):
            yield from _walk(item.items)


def _moves(plan: Plan, model: ChainModel) -> list[tuple[float, int, Item, tuple[Item, ...]]]:
    """Every single move: (time it saves, bytes it adds to what is held, item, replacement)."""
    stage_of = {u.path: i for i, u in enumerate(model.units)}
    moves = []
    for item in _walk(plan.items):
        if isinstance(item, Segment):
            saved = sum(model.units[stage_of[p]].fwd_time for p in item.paths)
            moves.append((saved, 0, item, item.items))
            regions = tuple(UnitChoice(p, RECOMPUTE) for p in item.paths)
            moves.append((saved, 0, item, regions))
            continue
        stage = stage_of[item.path]
        options = model.options[stage]
        costs = model.chain.stages[stage].options
        current = next((k for k, o in enumerate(options) if o == item.decision), None)
        if current is None:
            continue
        for k, option in enumerate(options):
            if k != current:
                saved = costs[current].time - costs[k].time
                extra = (costs[k].kept - costs[current].kept) * model.unit_bytes
                moves.append((saved, extra, item, (UnitChoice(item.path, option),)))
    return moves


def _apply(plan: Plan, item: Item, new: tuple[Item, ...]) -> Plan | None:
    if not any(i is item for i in _walk(plan.items)):
        return None  # an earlier move replaced it
    return Plan(_replace(plan.items, item, new), plan.fingerprint, offload=plan.offload)


def _apply_all(plan: Plan, moves: list) -> Plan | None:
    for _saved, _extra, item, new in moves:
        plan = _apply(plan, item, new)
        if plan is None:
            return None
    return plan


def polish(
    profile: Profile, plan: Plan, budget: int, model: ChainModel, pred: Prediction | None = None,
    tie: float = 0.0,
) -> tuple[Plan, Prediction]:  # fmt: skip
    """Greedy single moves that save time and keep ``plan`` within ``budget`` on the simulator.

    Returns the plan and its prediction (``pred``, the plan's own, saves one simulation).
    A move is taken only when it saves more than ``tie`` seconds: two fresh profiles
    price a near-equal move a hair either way, and the plan must not follow the noise.
    Moves are tried in groups that grow while they fit and shrink to one move after a
    group does not: a deep model of identical blocks has hundreds of moves that all
    fit, or none, and one simulation then settles many of them. While each added move
    only raises the peak (the usual case), the result is the one-at-a-time result.

    Example:
        >>> plan, pred = polish(prof, plan, 600 << 20, model)
    """
    best = pred or simulate(profile, plan)
    moves = [m for m in _moves(plan, model) if m[0] > 0]
    # Cheapest bytes per second saved first: those are the moves likely to fit.
    moves.sort(key=lambda m: max(m[1], 0) / m[0])
    records = len(profile.storages) + len(profile.packs)
    limit = max(_POLISH_FLOOR, min(_POLISH_SIMULATIONS, _POLISH_RECORDS // max(records, 1)))
    start, group, simulations = 0, 1, 0
    while start < len(moves) and simulations < limit:
        chunk = moves[start : start + group]
        candidate = _apply_all(plan, chunk)
        if candidate is None:  # an earlier move replaced one of these items
            if group == 1:
                start += 1
            group = 1
            continue
        trial = simulate(profile, candidate)
        simulations += 1
        if trial.peak_bytes <= budget and trial.step_time < best.step_time - tie:
            plan, best = candidate, trial
            start += len(chunk)
            group *= 2
        elif group > 1:
            group = 1  # retry the first of them alone
        else:
            start += 1
    return plan, best


def repair(profile: Profile, plan: Plan, budget: int, model: ChainModel) -> tuple[Plan, Prediction]:
    """Greedy single moves that lower the peak, until ``plan`` fits ``budget`` (or none helps)."""
    best = simulate(profile, plan)
    for _ in range(_REPAIR_ROUNDS):
        if best.peak_bytes <= budget:
            break
        moves = [m for m in _moves(plan, model) if m[1] < 0 or isinstance(m[2], Segment)]
        moves.sort(key=lambda m: m[1] / max(-m[0], 1e-9))  # most bytes freed per second spent
        round_best: tuple[float, Plan, Prediction] | None = None
        for _saved, _extra, item, new in moves[:_REPAIR_CANDIDATES]:
            candidate = _apply(plan, item, new)
            if candidate is None:
                continue
            pred = simulate(profile, candidate)
            freed = best.peak_bytes - pred.peak_bytes
            if freed <= 0:
                continue
            score = freed / max(pred.step_time - best.step_time, 1e-9)
            if round_best is None or score > round_best[0]:
                round_best = (score, candidate, pred)
        if round_best is None:
            break
        _, plan, best = round_best
    return plan, best
