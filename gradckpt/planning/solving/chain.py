"""From a profile to the dynamic program's chain of stages.

Each plannable unit becomes a stage with its options: the decisions every
registered kind offers for it (keep, recompute, and selective save sets drawn
from the unit's own time-per-byte frontier; see :mod:`gradckpt.planning.kinds`). What
each option *holds* after the forward comes straight from the profile's saved
tensors. What it *needs* at its peaks is calibrated on the exact simulator:
one simulated step per option index (every stage using that option) gives the
live bytes in each stage's forward and backward windows, and subtracting what
the chain model says is held by the stages before leaves the stage's own
requirement, background included (gradients, logits, masks). So the model is
exact for those uniform plans and close for mixed ones; the solver checks every
plan it returns on the simulator anyway.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gradckpt.engine.decisions import KEEP, RECOMPUTE, Decision, Offload
from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.planning.handlers.lookup import Lookup, build_lookup
from gradckpt.planning.handlers.registry import handler_for, handlers
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, UnitChoice
from gradckpt.planning.simulation.costs import engine_seconds, step_costs, unit_counts
from gradckpt.planning.simulation.simulate import live_trace, region_state_bytes
from gradckpt.planning.solving.dp_chain import Chain, Option, Stage
from gradckpt.profiling.records import NEVER, Profile, UnitRecord

__all__ = ["ChainModel", "build_chain", "with_engine_costs"]

_GRID, _GRID_PER_STAGE = 1024, 8  # memory grid steps: at least, and per stage


@dataclass(frozen=True)
class ChainModel:
    """The chain, the unit behind each stage, and the memory grid it uses."""

    chain: Chain
    units: tuple[UnitRecord, ...]
    options: tuple[tuple[Decision, ...], ...]  # per stage: the decision of each DP option
    unit_bytes: int
    base_bytes: int  # parameters and buffers: outside the grid
    offload: OffloadOptions | None = None  # the link offload options were costed for

    def to_units(self, nbytes: int) -> int:
        """Memory left for the chain under a budget of ``nbytes``, in grid units (floor)."""
        return max(-1, (nbytes - self.base_bytes) // self.unit_bytes)


def _kept_bytes(profile: Profile, unit: UnitRecord, option: Decision, look: Lookup) -> int:
    """Bytes the unit holds from its forward to its backward, besides its input and output.

    A region also keeps its RNG state until its backward: counted here, as held by
    the stage, and not in the requirements of the stages after it, which would then
    differ block by block and no two blocks could share the DP's tables.
    """
    kind = handler_for(option)
    state = region_state_bytes(profile) if kind.opens_region else 0
    sids = kind.kept_storages(profile, unit, option, look)
    sids.discard(unit.output)
    # An option that moves the unit's input off the device (offloaded boundary) frees
    # what the chain counts as held before it: negative when it frees more than it keeps.
    released = kind.released_input_bytes(profile, unit, option, look)
    return state + sum(profile.storages[s].nbytes for s in sids) - released


def _own_forward_peak(profile: Profile, unit: UnitRecord, option: Decision, look: Lookup) -> int:
    """Peak of the unit's own storages during its forward (what it keeps is never freed)."""
    kept = handler_for(option).kept_storages(profile, unit, option, look)
    positions = look.forward_positions
    events = []
    for op in profile.unit_ops(unit):
        if op.workspace:  # held while the op runs, on top of its outputs
            events += [(op.index, 2, op.workspace), (op.index, 3, -op.workspace)]
        for sid in op.outputs:
            s = profile.storages[sid]
            events.append((op.index, 1, s.nbytes))
            if sid not in kept and s.natural_free != NEVER:
                done = bisect.bisect_left(positions, s.natural_free)
                if done < unit.end_op:
                    events.append((done - 0.5, 0, -s.nbytes))
    live = peak = 0
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def _windows(profile: Profile, units: tuple[UnitRecord, ...]) -> tuple[list, list]:
    """Forward and backward windows of each stage; together they tile the whole step.

    Code outside the units (embedding sums, the loss, its backward) falls into the
    window of the stage that runs just before it, so every peak is some stage's.
    """
    ops = profile.ops
    n_fwd = profile.forward_ops
    first_bwd = ops[n_fwd].position if n_fwd < len(ops) else profile.end
    starts = [ops[u.first_op].position - 1 for u in units]
    starts[0] = -1
    fwd = [(starts[i], (starts[i + 1] if i + 1 < len(units) else first_bwd) - 1)
           for i in range(len(units))]  # fmt: skip
    # Backward: a stage's window opens at its first backward event (or recompute)
    # and runs until the next stage's opens; stages are passed in reverse order.
    by_unit: dict[int, int] = {}
    for op in ops[n_fwd:]:
        if op.unit >= 0:
            by_unit[op.unit] = min(by_unit.get(op.unit, NEVER), op.position)
    for p in profile.packs:
        if p.unit >= 0 and p.unpack != NEVER:
            by_unit[p.unit] = min(by_unit.get(p.unit, NEVER), p.unpack)
    opens = [by_unit.get(u.index, NEVER) - 2 for u in units]
    opens[-1] = first_bwd - 1
    for i in range(len(units) - 2, -1, -1):  # keep them ordered: later stages open first
        opens[i] = max(opens[i], opens[i + 1]) if opens[i] < NEVER - 2 else opens[i + 1]
    bwd = [(opens[i], (opens[i - 1] if i > 0 else NEVER) - 1) for i in range(len(units))]
    return fwd, bwd


def _calibration_runs(
    units: tuple[UnitRecord, ...], options: list[list[Decision]]
) -> list[list[int]]:
    """Option index per stage for each calibration simulation.

    All keep; then each block option with the other units kept (the plans people
    use: blocks checkpointed, embeddings and head kept); then the other units
    recomputed with the blocks kept.
    """
    runs = [[0] * len(units)]
    width = max((len(o) for u, o in zip(units, options) if u.is_block), default=0)
    for k in range(1, width):
        runs.append([k if u.is_block and k < len(o) else 0 for u, o in zip(units, options)])
    if not all(u.is_block for u in units):
        runs.append([0 if u.is_block else 1 for u in units])
    # Further options of other units (a chunked head's): each with the blocks kept.
    extra = max((len(o) for u, o in zip(units, options) if not u.is_block), default=0)
    for k in range(2, extra):
        runs.append([k if not u.is_block and k < len(o) else 0 for u, o in zip(units, options)])
    if width < 2:  # no blocks: their recompute option still needs calibrating
        runs.append([1] * len(units))
    return runs


def _window_levels(positions: list[int], lives: list[int], window) -> tuple[int, int]:
    """(live bytes entering the window, peak inside it)."""
    start, stop = window
    lo = bisect.bisect_left(positions, start)
    hi = bisect.bisect_right(positions, stop)
    entering = lives[lo - 1] if lo > 0 else 0
    return entering, max([entering, *lives[lo:hi]])


def build_chain(
    profile: Profile, grid: int | None = None, *, settings: Mapping[type, Any] | None = None
) -> ChainModel:
    """The DP chain for ``profile`` on a memory grid of ``grid`` steps up to the plain peak.

    The default grid has 1024 steps, and 8 per stage on deeper models: what a stage
    keeps is rounded to the grid and summed along the chain, so a block that keeps
    one or two steps would make the model miss by a quarter on 400 blocks.

    ``settings`` maps a Decision class to what its kind's handler reads while it
    offers and costs options (``look.settings``); a kind may offer nothing unless
    it is given settings.

    With ``settings={Offload: OffloadOptions(...)}``, every block also gets an
    ``Offload`` option (third after keep and recompute;
    :mod:`gradckpt.planning.kinds.offload.handler`): it holds what it does not move, its time
    adds the copies' stall with the next unit's compute as the overlap windows, and
    (like any kind whose handler is not ``nested``) it is never chosen inside a
    segment's recompute.

    Example:
        >>> model = build_chain(prof)
        >>> model.chain.capacity, model.unit_bytes
    """
    units = tuple(u for u in profile.units if u.plannable)
    if not units:
        raise ValueError("the model has no unit that can be checkpointed")
    grid = grid or max(_GRID, _GRID_PER_STAGE * len(units))
    look = build_lookup(profile, units, settings)
    offload = look.settings.get(Offload)  # the link offload options are costed for
    kinds = list(handlers())
    stage_options: list[list[Decision]] = []
    for u in units:
        options = [o for kind in kinds for o in kind.stage_options(profile, u, look)]
        # The chain model reads option 0 as the plain unit and option 1 as a full region.
        assert options[:2] == [KEEP, RECOMPUTE], f"internal: options of {u.path}: {options[:2]}"
        stage_options.append(options)
    base = profile.param_bytes + profile.resident_bytes  # held through the whole step
    span = max(1, profile.measured_peak_bytes - base)
    unit_bytes = max(1, math.ceil(span / grid))

    def up(nbytes: float) -> int:
        return max(0, math.ceil(nbytes / unit_bytes))

    inputs = [0] + [
        profile.storages[u.chain_input].nbytes if u.chain_input >= 0 else 0 for u in units[1:]
    ]

    def near(nbytes: float) -> int:
        # Held sizes are summed along the chain: round to nearest so errors cancel
        # (the simulator checks every plan); requirements round up.
        return max(0, round(nbytes / unit_bytes))

    kept = [
        [_kept_bytes(profile, u, o, look) for o in opts] for u, opts in zip(units, stage_options)
    ]
    fwd_windows, bwd_windows = _windows(profile, units)
    fwd_need = [[0] * len(o) for o in stage_options]
    bwd_need = [[0] * len(o) for o in stage_options]
    bstart_background = [0] * len(units)
    for index in _calibration_runs(units, stage_options):
        plan = Plan(
            tuple(
                UnitChoice(u.path, stage_options[i][k])
                for i, (u, k) in enumerate(zip(units, index))
            ),
            profile.fingerprint,
            offload=offload,
        )
        positions, lives, _ = live_trace(profile, plan)
        held = 0
        for i, k in enumerate(index):
            held += inputs[i]
            _, peak_f = _window_levels(positions, lives, fwd_windows[i])
            enter_b, peak_b = _window_levels(positions, lives, bwd_windows[i])
            fwd_need[i][k] = peak_f - held
            bwd_need[i][k] = peak_b - held
            if not any(index):
                bstart_background[i] = enter_b - held - kept[i][0]
            held += kept[i][k]
    # Requirements stay in bytes (the DP rounds them per cell). What each stage's
    # backward leaves live for the rest of the step (its gradients) is split off:
    # a stage's requirement here counts the gradients of every later stage, and
    # the DP adds back only those of the later stages in the same cell, so that
    # identical blocks get identical stages (see gradckpt.planning.solving.dp).
    later = [bstart_background[i] - bstart_background[-1] for i in range(len(units))]
    stages = []
    for i, u in enumerate(units):
        opts = []
        for k, option in enumerate(stage_options[i]):
            own = _own_forward_peak(profile, u, option, look)
            kind = handler_for(option)
            recompute = kind.recompute_seconds(profile, u, option, look)  # offload: its stall
            opts.append(
                Option(
                    name=kind.option_name(option, k),
                    kept=round(kept[i][k] / unit_bytes),  # signed (see _kept_bytes)
                    fwd=fwd_need[i][k],
                    # A kind that cannot run inside a segment's recompute (offload would
                    # only move bytes back and forth there) is out of reach there.
                    fwd_nested=(own + max(0, bstart_background[i]) - later[i])
                    if kind.nested else NEVER,
                    bwd=bwd_need[i][k] - later[i],
                    time=u.fwd_time + u.bwd_time + recompute,
                )
            )
        stages.append(
            Stage(
                input=near(inputs[i]),
                options=tuple(opts),
                none=opts[1].fwd,
                none_nested=opts[1].fwd_nested,
                fwd_time=u.fwd_time,
                joins_previous=i > 0 and u.chained and units[i - 1].index == u.index - 1,
                grad=bstart_background[i - 1] - bstart_background[i] if i > 0 else 0,
            )
        )
    return ChainModel(
        # Headroom above the plain peak: the solver asks the DP slightly above the
        # budget too, since rounding may put the plain schedule a few units over.
        chain=Chain(tuple(stages), capacity=math.ceil(1.06 * up(span)) + 8, scale=unit_bytes),
        units=units,
        options=tuple(tuple(o) for o in stage_options),
        unit_bytes=unit_bytes,
        base_bytes=base,
        offload=offload,
    )


def with_engine_costs(model: ChainModel, profile: Profile) -> ChainModel:
    """The DP chain with each option's time raised by what the engine costs to run it.

    Example:
        >>> dp = ChainDP(with_engine_costs(build_chain(prof), prof).chain)
    """
    costs = step_costs(profile)
    if costs == EngineCosts(device=costs.device):
        return model
    stages = []
    for stage, unit, options in zip(model.chain.stages, model.units, model.options):
        timed = tuple(
            replace(o, time=o.time + engine_seconds(unit_counts(profile, unit, c), costs))
            for o, c in zip(stage.options, options)
        )
        # Inside a segment's recompute the unit reruns whole, on the hooks alone (lean).
        rerun = replace(unit_counts(profile, unit, RECOMPUTE), regions=0)
        rerun = replace(rerun, recompute_ops=unit.end_op - unit.first_op, mode_ops=0)
        fwd_time = stage.fwd_time + engine_seconds(rerun, costs)
        stages.append(replace(stage, options=timed, fwd_time=fwd_time))
    return replace(model, chain=replace(model.chain, stages=tuple(stages)))
