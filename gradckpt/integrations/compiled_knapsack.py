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
        sweep: knapsack capacities to try over the whole range (more: finer
            choice, slower partitioning; each distinct answer costs one
            min-cut). The compiler's own knob values 0, 0.05, ..., 1 are tried too.

    ``chosen`` records a :class:`Partition` per partitioned graph.

    Example:
        >>> solver = SavedBytesSolver(0.5)
        >>> with torch._functorch.config.patch(activation_memory_budget_solver=solver,
        ...                                    activation_memory_budget=1e-6): ...
    """

    def __init__(self, fraction: float, sweep: int = 24) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"SavedBytesSolver: fraction {fraction!r} is outside [0, 1]; it is the share of the "
                "compiler default's saved bytes a graph may keep"
            )
        if sweep < 2:
            raise ValueError(f"SavedBytesSolver: sweep {sweep!r} must be at least 2")
        self.fraction = float(fraction)
        self.sweep = int(sweep)
        self.chosen: list[Partition] = []

    def uuid(self) -> Any:
        # Part of the compile cache key: graphs partitioned under different caps differ.
        return ("gradckpt.SavedBytesSolver", 1, self.fraction, self.sweep)

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


def _aggressive_options(p: Any) -> Any:
    """The rules the partitioner applies after its knapsack (every ban rule but reductions off)."""
    return p.MinCutOptions(
        ban_if_used_far_apart=False,
        ban_if_long_fusible_chains=False,
        ban_if_materialized_backward=False,
        ban_if_not_in_allowlist=False,
        ban_if_reduction=p.config.ban_recompute_reductions,
    )


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
def saved_bytes_cap(fraction: float, sweep: int = 24) -> Iterator[SavedBytesSolver]:
    """Graphs partitioned inside this block save at most ``fraction`` of the default's bytes.

    Example:
        >>> with saved_bytes_cap(0.4) as solver:
        ...     compiled_model(x).sum().backward()
        >>> solver.chosen  # a Partition per graph: default, cap, saved bytes
    """
    import torch._functorch.config as functorch_config

    solver = SavedBytesSolver(fraction, sweep)
    with functorch_config.patch(**saved_bytes_config(solver)):
        yield solver
