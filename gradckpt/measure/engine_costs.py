"""What gradckpt's own machinery costs per op, per saved tensor and per region.

A checkpointed region does more than run its ops twice: each saved tensor goes
through pack and unpack hooks (a holder in the forward, a refill in the
recompute), entering a region captures RNG and autocast state and installs
hooks, and some regions run a Python dispatch mode on every op: a selective
region's forward asks its policy about every op, and a recompute that replays
kept outputs (or whose state is unknown) runs under ``RecomputeMode``. A
region that needs none of that recomputes on the saved-tensor hooks alone (the
lean path, :mod:`gradckpt.engine.writes`). On small ops these costs rival the
ops themselves, and a planner that ignores them picks plans that are slower
than predicted.

:func:`engine_costs` measures them once per process and device on chains of
tiny ops (where the kernels cost almost nothing), as differences between a
plain and a checkpointed step, on :func:`~gradckpt.measure.timing.work_clock`
(thread CPU time on the CPU: robust to other processes). Each kind of engine
event has its cost: a region, a saved tensor, an op of a lean recompute, an op
under the recompute's dispatch mode, an op shown to a policy; and the host's
time per op of a plain step (what a step of short ops is made of: dispatch,
autograd, Python), which a fake profile for another device takes as the least
an op costs there (:func:`gradckpt.profiling.fake.with_estimated_times`). The
planner adds them to its predicted time (:mod:`gradckpt.planning.simulation.costs`).

Tiny chains miss what a real block pays per op (ops with weights, views and
more arguments cost the dispatch modes more, and a real block's Python runs
again in a recompute), so a profile also times the forward of one of the model's own
blocks as a region and as a selective region (:func:`time_unit_regions`); the
planner takes the policy's per-op cost from that unit when it has one
(:func:`gradckpt.planning.simulation.costs.step_costs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gradckpt.engine import checkpoint
from gradckpt.engine.checkpoint import run_checkpointed
from gradckpt.measure.flops import count_ops
from gradckpt.measure.timing import low_estimate, work_clock

__all__ = [
    "EngineCosts",
    "UnitTimes",
    "engine_costs",
    "forget",
    "measure_engine_costs",
    "time_unit_regions",
]


@dataclass(frozen=True)
class EngineCosts:
    """Seconds gradckpt's engine adds to a step, per event (all zero: not measured).

    Example:
        >>> costs = engine_costs("cpu")
        >>> costs.recompute_op * 100  # the dispatch cost of recomputing 100 ops
    """

    region: float = 0.0  # entering and leaving a region, forward and one recompute
    recompute_op: float = 0.0  # an op run (or replayed) in a recompute under the dispatch mode
    policy_op: float = 0.0  # an op of a selective region's forward (the policy is asked)
    saved_tensor: float = 0.0  # a tensor saved inside a region: pack, refill, unpack
    device: str = ""
    lean_op: float = 0.0  # an op run in a lean recompute (the saved-tensor hooks alone)
    host_op: float = 0.0  # the host's time per op of a plain step of tiny ops
    # One of the model's own units, timed (seconds; "" and 0: not measured): its forward
    # as a region, and what a policy asked about each of its ops adds to it. The
    # planner's per-op policy cost comes from these.
    unit: str = ""
    unit_region: float = 0.0
    unit_policy: float = 0.0
    # The same unit's step (forward and backward) plain and as a (lean) region, and its
    # plain forward (0: not timed): the engine's real cost on it, which scales the chains'.
    unit_step: float = 0.0
    unit_region_step: float = 0.0
    unit_forward: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> EngineCosts:
        # Profiles before issue #31's last change also timed the unit plain
        # ("unit_plain") and its region with a backward; nothing prices those.
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})


# Chains of tiny ops: long enough that per-op costs stand out of the per-step ones.
_SHORT, _LONG = 8, 40
_ROUNDS, _STEPS = 5, 4
_CACHE: dict[str, EngineCosts] = {}


class _Chain(nn.Module):
    """``k`` tiny ops: a module, so its region recomputes lean.

    Adds (autograd saves nothing for them) and a closing sine (one saved tensor:
    the region has something to recompute), or ``k`` sines (each saves its input).
    """

    def __init__(self, k: int, *, sines: bool = False) -> None:
        super().__init__()
        self.k, self.sines = k, sines

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.k):
            x = x.sin() if self.sines else x + 1.0
        return x if self.sines else x.sin()


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from gradckpt.engine import RECOMPUTE

    return RECOMPUTE


def _steps(fn: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The step variants whose differences give the engine's costs for ``fn``."""

    def plain() -> None:
        fn(x).sum().backward()

    def forward() -> None:  # what the recompute redoes: the forward with its graph
        fn(x).sum()

    def region() -> None:  # a module's region: it recomputes lean
        checkpoint(fn, x).sum().backward()

    def per_op() -> None:  # a function's region (its state unknown): under the mode
        checkpoint(lambda t: fn(t), x).sum().backward()

    def selective() -> None:  # the policy keeps nothing: only its forward differs
        checkpoint(fn, x, policy=_recompute_all).sum().backward()

    return {
        "plain": plain, "forward": forward, "region": region, "per_op": per_op,
        "selective": selective,
    }  # fmt: skip


def _time_all(
    cases: dict[str, Callable[[], None]], clock: Callable[[], float], sync: Callable[[], None]
) -> dict[str, float]:
    """Seconds per run of each case: least over rounds, cases interleaved in each round."""
    for fn in cases.values():  # warm-up: lazy initialization, allocator
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(_ROUNDS):
        for name, fn in cases.items():
            sync()
            start = clock()
            for _ in range(_STEPS):
                fn()
            sync()
            samples[name].append((clock() - start) / _STEPS)
    return {name: low_estimate(times) for name, times in samples.items()}


def _synchronizer(where: torch.device) -> Callable[[], None]:
    """Waits for ``where``'s queued work (a no-op on CPU), so a clock reads finished work."""
    module = getattr(torch, where.type, None)
    if where.type in ("cpu", "meta") or module is None:
        return lambda: None
    return module.synchronize


def measure_engine_costs(device: str | torch.device = "cpu") -> EngineCosts:
    """Measure the engine's costs on ``device`` now (about 0.1 s of CPU after the one-time start-up of dispatch modes); see :func:`engine_costs`.

    Three chains are timed plain, forward only and checkpointed: ``k`` adds and
    a sine (one saved tensor) for two ``k``, and ``k`` sines (``k`` saved
    tensors). A checkpointed step minus the plain step minus the forward it
    redoes is ``region + ops * lean_op + saved * saved_tensor``; the three
    chains give the three unknowns. The long chain checkpointed as a function
    (recomputed under the dispatch mode) minus as a module gives what the mode
    adds per op (``recompute_op`` is ``lean_op`` plus that); with a policy that
    recomputes everything, minus the plain region, it gives ``policy_op``. The
    plain step of the sines over the ops it runs gives ``host_op``.

    Example:
        >>> measure_engine_costs("cpu").recompute_op
    """
    where = torch.device(device)
    clock, sync = work_clock(where), _synchronizer(where)
    x = torch.ones(16, device=where, requires_grad=True)
    short, long, sines = _Chain(_SHORT), _Chain(_LONG), _Chain(_LONG, sines=True)
    cases = {}
    for label, fn in (("short", short), ("long", long), ("sines", sines)):
        for kind, step in _steps(fn, x).items():
            if kind in ("plain", "forward", "region") or label == "long":
                cases[f"{label}.{kind}"] = step
    with torch.random.fork_rng(devices=[]):
        t = _time_all(cases, clock, sync)
        ops = sum(count_ops(cases["sines.plain"]).values())
    x.grad = None

    def extra(label: str) -> float:
        return t[f"{label}.region"] - t[f"{label}.plain"] - t[f"{label}.forward"]

    # extra(adds k) = region + saved + (k + 1) op; extra(sines k) = region + k saved + k op.
    per_op = max(0.0, (extra("long") - extra("short")) / (_LONG - _SHORT))
    saved = max(
        0.0, (extra("sines") - extra("short") - (_LONG - _SHORT - 1) * per_op) / (_LONG - 1)
    )
    region = max(0.0, extra("short") - saved - (_SHORT + 1) * per_op)
    mode = max(0.0, (t["long.per_op"] - t["long.region"]) / (_LONG + 1))
    policy = max(0.0, (t["long.selective"] - t["long.region"]) / (_LONG + 1))
    host = t["sines.plain"] / max(1, ops)
    return EngineCosts(
        region, per_op + mode, policy, saved, where.type, lean_op=per_op, host_op=host
    )


@dataclass(frozen=True)
class UnitTimes:
    """Seconds of a real unit's forward as a region, and what a policy asked about every
    op adds to it; and, for a short unit, its step (forward and backward) plain and as a
    region, and its plain forward (0: not timed)."""

    region: float
    policy: float
    step: float = 0.0
    region_step: float = 0.0
    forward: float = 0.0


#: A unit whose region forward takes longer than this is not timed as whole steps
#: too: the engine's part of its step is below a percent, and a step costs seconds.
_STEPS_UP_TO = 0.02


def time_unit_regions(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    device: str | torch.device = "cpu",
    rounds: int = 2 * _ROUNDS,
) -> UnitTimes:
    """Time ``fn(*args, **kwargs)``'s forward as a region and as a selective region (a
    policy asked about every op, recomputing all of them): the policy's cost is the
    difference of the two, which are short, so it stands out of the noise better than in
    whole steps. The two are interleaved in each round and each takes its least time over
    the rounds, on :func:`~gradckpt.measure.timing.work_clock`. The RNG is left as found;
    the caller restores anything else ``fn`` changes (buffers).

    A module whose region forward is short (under 20 ms) is also timed as whole steps
    (forward and the backward of its outputs' sum), plain and as a region (a module's:
    recomputed lean), and as its plain forward: the region's step minus the plain one
    minus the forward it reruns is what the engine costs on this unit, which the
    planner compares with what the tiny chains predict for it. Gradients the steps
    leave on ``fn``'s parameters are put back as they were.

    Example:
        >>> t = time_unit_regions(block, (x,), {})
        >>> t.policy / n_ops  # what asking a policy costs per op
    """
    where = torch.device(device)
    clock, sync = work_clock(where), _synchronizer(where)

    def call(*a: Any) -> Any:  # keyword arguments by closure: none can clash with checkpoint's
        return fn(*a, **kwargs)

    cases = {
        "region": lambda: checkpoint(call, *args),
        "policy": lambda: checkpoint(call, *args, policy=_recompute_all),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    with torch.random.fork_rng(devices=[]), _grads_kept(fn):
        for once in cases.values():  # warm-up
            once()
        start = clock()
        cases["region"]()
        if isinstance(fn, nn.Module) and clock() - start < _STEPS_UP_TO:
            cases.update(_unit_steps(fn, args, kwargs))
            for name in ("step", "region_step", "forward"):
                samples[name] = []
                cases[name]()  # warm-up
        for _ in range(rounds):
            for name, once in cases.items():
                sync()
                start = clock()
                once()
                sync()
                samples[name].append(clock() - start)
    t = {name: low_estimate(times) for name, times in samples.items()}
    return UnitTimes(
        t["region"], t["policy"] - t["region"],
        t.get("step", 0.0), t.get("region_step", 0.0), t.get("forward", 0.0),
    )  # fmt: skip


def _unit_steps(
    module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> dict[str, Callable[[], None]]:
    def loss(out: Any) -> torch.Tensor | None:
        parts = [
            t.sum() for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
        ]  # fmt: skip
        return torch.stack(parts).sum() if parts else None

    def backward(out: Any) -> None:
        total = loss(out)
        if total is not None:
            total.backward()

    return {
        "step": lambda: backward(module(*args, **kwargs)),
        "region_step": lambda: backward(run_checkpointed(module, args, kwargs)),
        "forward": lambda: loss(module(*args, **kwargs)),
    }


@contextlib.contextmanager
def _grads_kept(fn: Any) -> Iterator[None]:
    """Put the gradients of ``fn``'s parameters (a module's) back as they were."""
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    kept = [p.grad.clone() if p.grad is not None else None for p in params]
    try:
        yield
    finally:
        for p, grad in zip(params, kept):
            p.grad = grad


def engine_costs(device: str | torch.device = "cpu") -> EngineCosts:
    """The engine's costs on ``device``, measured on first use and kept for the process.

    Every profile made in one process carries the same costs, so they never make
    two plans of one model differ. A "meta" device costs nothing (nothing runs).

    Example:
        >>> engine_costs("cpu").region
    """
    kind = torch.device(device).type
    if kind == "meta":
        return EngineCosts(device="meta")
    key = str(torch.device(device))
    if key not in _CACHE:
        _CACHE[key] = measure_engine_costs(device)
    return _CACHE[key]


def forget() -> None:
    """Drop the costs kept for this process: the next :func:`engine_costs` measures again.

    Example:
        >>> forget(); engine_costs("cpu")  # measured afresh
    """
    _CACHE.clear()
