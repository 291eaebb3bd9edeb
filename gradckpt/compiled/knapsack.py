"""The compiler's partitioner held to a cap in *saved bytes*, chosen on the compiled graph itself.

torch.compile's ``activation_memory_budget`` is a fraction of a knapsack over
the partitioner's "banned" nodes (those it would otherwise save), sized in
units of the gap between its default and its minimal saved set. After the
knapsack, a min-cut decides what is really saved, and that set's bytes are
not monotone in the knob (pytorch#197838): at 0.1 a GPT-2 step saves more
than at 0.5.

:class:`SavedBytesSolver` plugs into the partitioner
(``torch._functorch.config.activation_memory_budget_solver``) and plans on
the joint graph the compiler runs, fused ops and all. It solves the
partitioner's knapsack at a sweep of capacities, runs the partitioner's own
min-cut for each answer to get the bytes that answer *really* saves, and
returns the answer with the least estimated recompute among those whose
saved bytes fit the cap (ties: fewer bytes). The cap is a fraction of the
bytes the compiler's default partition saves for that graph, so for one
graph a larger cap admits a superset of answers and the chosen recompute
never grows. Recompute is estimated by the partitioner's own estimator
(FLOPs, as ``activation_memory_budget_runtime_estimator="flops"``, torch's
default: fused pointwise work is nearly free, matmuls are not).

:func:`saved_bytes_cap` installs it for the code in its block (the
partitioner runs at the first compiled call and on recompiles).

Example:
    >>> model.compile(backend="inductor")
    >>> with saved_bytes_cap(0.5):
    ...     model(x).sum().backward()  # partitioned: saves <= half the default's bytes
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch._inductor.custom_graph_pass import CustomKnapsackSolver

__all__ = ["Partition", "SavedBytesSolver", "saved_bytes_cap", "saved_bytes_config"]

# The partitioner reads a budget of exactly 0 or 1 as "no knapsack"; any value
# strictly between makes it call the solver (its own capacity is then ignored).
_ANY_KNAPSACK_BUDGET = 1e-6
_KNOB_STEPS = 20  # the compiler's knob values tried: 0, 0.05, ..., 1


class Partition(NamedTuple):
    """What :class:`SavedBytesSolver` chose for one graph (bytes as the partitioner sizes them)."""

    default_bytes: int  # what the partitioner's default choice saves
    cap_bytes: float
    saved_bytes: int  # what the chosen answer saves (min-cut after the knapsack)
    recompute_flops: float  # estimated cost of the banned nodes it recomputes


class SavedBytesSolver(CustomKnapsackSolver):
    """A knapsack solver for the min-cut partitioner that caps what a graph really saves.

    Args:
        fraction: the cap, as a fraction of the bytes the partitioner's default
            (runtime-optimised) choice saves for the same graph; in [0, 1].
        knob: instead of ``fraction``, the cap is what the compiler's own
            ``activation_memory_budget=knob`` saves for the same graph (its whole
            route, :func:`_knob_saved_bytes`): the answer then saves no more bytes
            than the compiler's at that knob and recomputes no more FLOPs than
            any answer of the sweep that fits, the compiler's own knapsack answer
            included (random ops aside, which it never offers).
        sweep: knapsack capacities to try over the whole range (more: finer
            choice, slower partitioning; each distinct answer costs one
            min-cut). The compiler's own knob values 0, 0.05, ..., 1 are tried too.

    ``chosen`` records a :class:`Partition` per partitioned graph.

    Example:
        >>> solver = SavedBytesSolver(0.5)  # or SavedBytesSolver(knob=0.5)
        >>> with torch._functorch.config.patch(activation_memory_budget_solver=solver,
        ...                                    activation_memory_budget=1e-6): ...
    """

    def __init__(
        self, fraction: float | None = None, sweep: int = 24, *, knob: float | None = None
    ) -> None:
        if (fraction is None) == (knob is None):
            raise ValueError(
                "SavedBytesSolver: give exactly one of fraction= (a share of the default's saved "
                "bytes) and knob= (the bytes the compiler's own activation_memory_budget saves)"
            )
        for name, value in (("fraction", fraction), ("knob", knob)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"SavedBytesSolver: {name} {value!r} is outside [0, 1]; "
                    + ("it is the share of the compiler default's saved bytes a graph may keep"
                       if name == "fraction" else "it is an activation_memory_budget value")
                )  # fmt: skip
        if sweep < 2:
            raise ValueError(f"SavedBytesSolver: sweep {sweep!r} must be at least 2")
        self.fraction = None if fraction is None else float(fraction)
        self.knob = None if knob is None else float(knob)
        self.sweep = int(sweep)
        self.chosen: list[Partition] = []

    def uuid(self) -> Any:
        # Part of the compile cache key: graphs partitioned under different caps differ.
        return ("gradckpt.SavedBytesSolver", 2, self.fraction, self.knob, self.sweep)

    def __call__(
        self,
        memory: list[float],
        joint_graph: torch.fx.Graph,
        max_memory: float,
        node_info: Any,
        all_recomputable_banned_nodes: list[torch.fx.Node],
    ) -> tuple[list[int], list[int]]:
        from torch._functorch import partitioners as p
        from torch._functorch._activation_checkpointing.knapsack import dp_knapsack

        banned = all_recomputable_banned_nodes
        runtimes = [_flops(node) for node in banned]
        # A random op recomputed in backward draws a new mask unless the backend
        # replays its seed (inductor does, aot_eager does not: the partitioner's
        # own knob at 0.1 then changes a dropout GPT's gradients). Never offered.
        random = [_is_random(node) for node in banned]
        offered = [i for i, r in enumerate(random) if not r]
        pinned = [i for i, r in enumerate(random) if r]
        offered_memory = [memory[i] for i in offered]
        offered_runtimes = [runtimes[i] for i in offered]
        default_bytes = _saved_bytes(p, joint_graph, node_info, _default_options(p))
        if self.knob is not None:
            cap = float(_knob_saved_bytes(p, joint_graph, node_info, memory, runtimes, banned,
                                          self.knob, default_bytes))  # fmt: skip
        else:
            cap = self.fraction * default_bytes
        answers: dict[frozenset[int], tuple[float, int, list[int], list[int]]] = {}
        total = sum(offered_memory)
        # The whole range, and the compiler's own knob values on a 0.05 grid
        # (memory is normalised so that 1 is its default): at a cap no smaller
        # than what the compiler's answer at such a knob saves, that answer is
        # a candidate, so the chosen one recomputes no more FLOPs than it.
        capacities = sorted(
            {total * i / (self.sweep - 1) for i in range(self.sweep)}
            | {min(total, i / _KNOB_STEPS) for i in range(_KNOB_STEPS + 1)}
        )
        for capacity in capacities:
            _, kept, dropped = dp_knapsack(offered_memory, offered_runtimes, capacity)
            saved = pinned + [offered[i] for i in kept]
            recomputed = [offered[i] for i in dropped]
            key = frozenset(recomputed)
            if key in answers:
                continue
            dont_ban = p.OrderedSet(banned[i] for i in recomputed)
            saved_bytes = _saved_bytes(p, joint_graph, node_info, _aggressive_options(p), dont_ban)
            recompute = sum(runtimes[i] for i in recomputed)
            answers[key] = (recompute, saved_bytes, list(saved), list(recomputed))
        fitting = [a for a in answers.values() if a[1] <= cap]
        if fitting:
            best = min(fitting, key=lambda a: (a[0], a[1]))
        else:  # nothing fits: the least the partitioner can save
            best = min(answers.values(), key=lambda a: (a[1], a[0]))
        self.chosen.append(Partition(default_bytes, cap, best[1], best[0]))
        return best[2], best[3]


def _default_options(p: Any) -> Any:
    """The partitioner's own ban rules (what ``torch.compile`` uses at budget 1)."""
    config = p.config
    return p.MinCutOptions(
        ban_if_used_far_apart=config.ban_recompute_used_far_apart,
        ban_if_long_fusible_chains=config.ban_recompute_long_fusible_chains,
        ban_if_materialized_backward=config.ban_recompute_materialized_backward,
        ban_if_not_in_allowlist=config.ban_recompute_not_in_allowlist,
        ban_if_reduction=config.ban_recompute_reductions,
    )


def _more_aggressive_options(p: Any) -> Any:
    """The partitioner's first fallback below its default: three ban rules off."""
    return dataclasses.replace(
        _default_options(p),
        ban_if_used_far_apart=False,
        ban_if_long_fusible_chains=False,
        ban_if_materialized_backward=False,
    )


def _aggressive_options(p: Any) -> Any:
    """The rules the partitioner applies after its knapsack (every ban rule but reductions off)."""
    return p.MinCutOptions(
        ban_if_used_far_apart=False,
        ban_if_long_fusible_chains=False,
        ban_if_materialized_backward=False,
        ban_if_not_in_allowlist=False,
        ban_if_reduction=p.config.ban_recompute_reductions,
    )


def _knob_saved_bytes(
    p: Any, graph: Any, node_info: Any, memory: list[float], runtimes: list[float],
    banned: list[torch.fx.Node], knob: float, default: int,
) -> int:  # fmt: skip
    """The bytes the compiler's own ``activation_memory_budget=knob`` saves for this graph
    (``default``: what its default partition saves, computed once by the caller).

    The partitioner's route, step by step (``choose_saved_values_set``): its
    default at 1, only the inputs at 0, else the first of its "more aggressive"
    and "aggressive" min-cuts whose share of the default-to-inputs range is
    under the knob, else its knapsack at that capacity (every banned node
    offered, random ones too) followed by the aggressive min-cut.
    """
    from torch._functorch._activation_checkpointing.knapsack import dp_knapsack

    least = sum(p._size_of(node) for node in node_info.inputs)
    if knob >= 1.0 or default <= least:
        return default
    if knob <= 0.0:
        return least
    for options in (_more_aggressive_options(p), _aggressive_options(p)):
        saved = _saved_bytes(p, graph, node_info, options)
        if (saved - least) / (default - least) < knob:
            return saved
    _, _, dropped = dp_knapsack(memory, runtimes, knob)
    dont_ban = p.OrderedSet(banned[i] for i in dropped)
    return _saved_bytes(p, graph, node_info, _aggressive_options(p), dont_ban)


def _is_random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _flops(node: torch.fx.Node) -> float:
    """FLOPs of ``node`` from its traced shapes (at least 1: nothing is free to recompute).

    The solver runs with dispatch disabled, so the op cannot be executed under a
    FLOP-counting mode as the partitioner's own estimator does; torch's FLOP
    formulas take the shapes directly.
    """
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 1.0

    def value(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg

    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    return float(max(formula(*args, **kwargs, out_val=node.meta.get("val")), 1))


def _saved_bytes(p: Any, graph: Any, node_info: Any, options: Any, dont_ban: Any = None) -> int:
    saved, _ = p.solve_min_cut(graph, node_info, options, dont_ban)
    return sum(p._size_of(node) for node in saved)


def saved_bytes_config(solver: SavedBytesSolver) -> dict[str, Any]:
    """The ``torch._functorch.config`` values that make the partitioner call ``solver``.

    Example:
        >>> torch._functorch.config.patch(**saved_bytes_config(SavedBytesSolver(0.5)))
    """
    return dict(
        activation_memory_budget=_ANY_KNAPSACK_BUDGET, activation_memory_budget_solver=solver
    )


@contextlib.contextmanager
def saved_bytes_cap(
    fraction: float | None = None, sweep: int = 24, *, knob: float | None = None
) -> Iterator[SavedBytesSolver]:
    """Graphs partitioned inside this block save at most ``fraction`` of the default's bytes.

    Example:
        >>> with saved_bytes_cap(0.4) as solver:
        ...     compiled_model(x).sum().backward()
        >>> solver.chosen  # a Partition per graph: default, cap, saved bytes
    """
    import torch._functorch.config as functorch_config

    solver = SavedBytesSolver(fraction, sweep, knob=knob)
    with functorch_config.patch(**saved_bytes_config(solver)):
        yield solver
