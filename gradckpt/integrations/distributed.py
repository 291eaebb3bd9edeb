"""FSDP2 and DDP for planned models: one plan on every rank, and a per-rank budget.

Order, as in torchtitan: **plan/apply, then compile, then FSDP/DDP**::

    plan = fit_for_fsdp(model, loss_fn, "2GiB")            # every rank, before sharding
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Every rank must run the same plan (collectives are matched by order), so the
plan is made once, on rank ``src``, and broadcast; the other ranks neither
profile nor solve.

**FSDP plans have no segments.** FSDP2 gathers a module's parameters in its
pre-forward and pre-backward hooks. A single-unit region recomputes during
its unit's backward, after that unit's gather, so it sees full parameters; a
segment (one region over several units) recomputes all of them during its
last unit's backward, while the others are sharded. :func:`plan_for_fsdp`
plans with ``segments=False``; ``gradckpt.apply`` and the runtime refuse a
segment over an FSDP-sharded unit.

**The per-rank budget.** gradckpt profiles the whole model on one rank (or
under fake tensors) and then plans on a *per-rank view* of that profile
(:func:`rank_profile`): the same activations, temporaries and gradients, but
parameter memory as FSDP holds it on one rank::

    params(rank) = ceil(P_g / W) summed over groups      sharded parameters
                 + buffers                              (replicated)
                 + P_root                               root group: gathered from
                                                        its forward to its backward
                 + 2 * max_g P_g                        the block being gathered and
                                                        the one prefetched in backward
                 + max_g P_g                            the all-gather / reduce-scatter
                                                        buffer of one group

where ``P_g`` are the full parameter bytes of the groups ``fully_shard`` is
called on (the blocks by default; the root group is what no block holds) and
``W`` the world size. Gradients are counted full-size, as the profile measured
them, although FSDP reduce-scatters each group's gradients to 1/W in its
backward: conservative, so the measured per-rank peak stays under the budget.
DDP holds whole parameters and gradients on each rank; its gradient buckets
are allocated when DDP is built, before the step, so by gradckpt's definition
of the peak (storage created during the step) they need no adjustment.

:class:`RankMemoryTracker` measures one rank's peak by that definition with
FSDP: local shards as parameters, and the storage resizes through which FSDP2
gathers and frees parameters (a dispatch mode does not see them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from gradckpt.api import plan as gradckpt_plan
from gradckpt.api import profile as gradckpt_profile
from gradckpt.api.old_keywords import as_groups
from gradckpt.apply.apply import apply
from gradckpt.measure.memory import MemoryTracker
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan
from gradckpt.profiling.records import Profile
from gradckpt.profiling.units import find_blocks

__all__ = [
    "RankMemory",
    "RankMemoryTracker",
    "broadcast_plan",
    "fit_for_ddp",
    "fit_for_fsdp",
    "plan_for_ddp",
    "plan_for_fsdp",
    "rank_memory",
    "rank_profile",
]

LossFn = Callable[[], torch.Tensor]


# --------------------------------------------------------------- accounting


@dataclass(frozen=True)
class RankMemory:
    """Parameter memory of one FSDP rank, by the formula in the module docstring."""

    world_size: int
    full_param_bytes: int  # all parameters, unsharded (what a single process holds)
    sharded_param_bytes: int  # this rank's shards
    buffer_bytes: int
    root_gathered_bytes: int  # the root group's parameters, gathered for the whole step
    largest_group_bytes: int  # the largest sharded group's full parameters

    @property
    def param_bytes(self) -> int:
        """What one rank holds for parameters at its peak (see the module docstring)."""
        return (
            self.sharded_param_bytes
            + self.buffer_bytes
            + self.root_gathered_bytes
            + 3 * self.largest_group_bytes
        )


def _param_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _sharded_bytes(p: torch.Tensor, world_size: int) -> int:
    # FSDP2 shards dim 0, padded to a multiple of the world size.
    if p.dim() == 0:
        return p.element_size()
    rows = math.ceil(p.shape[0] / world_size)
    return rows * (p.numel() // max(p.shape[0], 1)) * p.element_size()


def rank_memory(
    model: nn.Module, world_size: int, groups: Sequence[str] | None = None
) -> RankMemory:
    """Parameter memory one rank holds when ``groups`` and then the root are ``fully_shard``ed.

    Args:
        model: the unsharded model (before ``fully_shard``).
        world_size: ranks sharing the parameters.
        groups: module paths ``fully_shard`` is called on, besides the root
            (default: the model's blocks, as found by ``gradckpt``).

    Example:
        >>> rank_memory(model, 8).param_bytes
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    paths = list(groups) if groups is not None else find_blocks(model)
    modules = dict(model.named_modules())
    missing = [p for p in paths if p not in modules]
    if missing:
        raise ValueError(f"groups name modules the model does not have: {missing}")
    seen: set[int] = set()
    group_bytes = []
    for path in paths:
        params = [p for p in modules[path].parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        group_bytes.append(_param_bytes(params))
    everything = list(model.parameters())  # deduplicated (tied weights once)
    root = [p for p in everything if id(p) not in seen]
    sharded = sum(_sharded_bytes(p, world_size) for p in everything)
    buffers = _param_bytes(model.buffers())
    if world_size == 1:
        return RankMemory(1, _param_bytes(everything), _param_bytes(everything), buffers, 0, 0)
    return RankMemory(
        world_size=world_size,
        full_param_bytes=_param_bytes(everything),
        sharded_param_bytes=sharded,
        buffer_bytes=buffers,
        root_gathered_bytes=_param_bytes(root),
        largest_group_bytes=max(group_bytes, default=0),
    )


def rank_profile(profile: Profile, memory: RankMemory) -> Profile:
    """``profile`` as one FSDP rank sees it: parameter memory replaced by ``memory``'s.

    The simulator and the solvers then predict and plan per-rank peaks.
    """
    params = memory.param_bytes
    return replace(
        profile,
        param_bytes=params,
        measured_peak_bytes=profile.measured_peak_bytes - profile.param_bytes + params,
    )


# ----------------------------------------------------------------- planning


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def broadcast_plan(plan: Plan | None, src: int = 0, group: Any = None) -> Plan:
    """Send ``plan`` from rank ``src`` to every rank of ``group``; returns it everywhere.

    Without an initialized process group it returns ``plan`` itself.
    """
    dist = _dist()
    if dist is None:
        if plan is None:
            raise ValueError("broadcast_plan needs a plan when there is no process group")
        return plan
    box = [plan.to_json() if plan is not None else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if isinstance(box[0], dict) and box[0].get("error"):
        raise RuntimeError(f"planning failed on rank {src}: {box[0]['error']}")
    return Plan.from_json(box[0])


def _plan_on_src(make: Callable[[], Plan], src: int, group: Any) -> Plan:
    """Run ``make`` on rank ``src`` only and broadcast its plan (or its error)."""
    dist = _dist()
    if dist is None:
        return make()
    if dist.get_rank() != src:
        return broadcast_plan(None, src, group)
    try:
        plan = make()
    except BaseException as exc:
        dist.broadcast_object_list(
            [{"error": f"{type(exc).__name__}: {exc}"}], src=src, group=group
        )
        raise
    return broadcast_plan(plan, src, group)


def _world_size(world_size: int | None, group: Any) -> int:
    if world_size is not None:
        return world_size
    dist = _dist()
    return dist.get_world_size(group) if dist is not None else 1


def plan_for_fsdp(
    model: nn.Module,
    loss_fn: LossFn,
    budget_per_rank: int | float | str,
    *,
    world_size: int | None = None,
    groups: Sequence[str] | None = None,
    src: int = 0,
    group: Any = None,
    profile: Profile | None = None,
    **plan_options: Any,
) -> Plan:
    """A segment-free plan whose per-rank peak under FSDP2 fits ``budget_per_rank``.

    Call it on every rank, before ``fully_shard``. Rank ``src`` profiles the
    whole model with ``loss_fn`` (one rank's batch), plans on the per-rank view
    of the profile (:func:`rank_profile`) and broadcasts the plan.

    Args:
        model: the unsharded model.
        loss_fn: one forward on this rank's batch, returning the loss.
        budget_per_rank: bytes, a string with units, or a fraction of the
            per-rank plain peak.
        world_size: ranks sharing the parameters (default: the process group's).
        groups: module paths ``fully_shard`` will be called on besides the root
            (default: the blocks).
        src: the rank that plans.
        group: the process group (default: the world).
        profile: a profile to plan from instead of measuring (e.g. a fake one).
        **plan_options: ``blocks``, ``solver``, ``repeats``, as for ``gradckpt.plan``.

    Example:
        >>> plan = plan_for_fsdp(model, loss_fn, "2GiB")
        >>> gradckpt.apply(model, plan)
    """
    size = _world_size(world_size, group)
    if plan_options.get("segments"):
        raise ValueError("FSDP plans cannot have segments (see gradckpt.integrations.distributed)")
    plan_options.pop("segments", None)
    solver = plan_options.pop("solver", "dp")

    def make() -> Plan:
        prof = profile if profile is not None else gradckpt_profile(
            model, loss_fn, blocks=plan_options.get("blocks"),
            repeats=plan_options.get("repeats", 3),
        )  # fmt: skip
        per_rank = rank_profile(prof, rank_memory(model, size, groups))
        # No chunking: its slices run when the loss reads the head's logits, after the
        # head's forward, when FSDP has resharded the head's weight.
        return Planner(per_rank, segments=False, chunking=False).plan(budget_per_rank, solver)

    return _plan_on_src(make, src, group)


def fit_for_fsdp(
    model: nn.Module, loss_fn: LossFn, budget_per_rank: int | float | str, **options: Any
) -> Plan:
    """:func:`plan_for_fsdp` and :func:`gradckpt.apply` (call before ``fully_shard``)."""
    chosen = plan_for_fsdp(model, loss_fn, budget_per_rank, **options)
    apply(model, chosen)
    return chosen


def plan_for_ddp(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    *,
    src: int = 0,
    group: Any = None,
    **plan_options: Any,
) -> Plan:
    """``gradckpt.plan`` made on rank ``src`` and broadcast, so every rank runs the same plan.

    DDP keeps whole parameters on every rank, so the per-rank budget is the
    single-process one and segments are allowed. Call it before wrapping the
    model in ``DistributedDataParallel``.
    """

    def make() -> Plan:
        return gradckpt_plan(model, loss_fn, budget, **as_groups(plan_options))

    return _plan_on_src(make, src, group)


def fit_for_ddp(
    model: nn.Module, loss_fn: LossFn, budget: int | float | str, **options: Any
) -> Plan:
    """:func:`plan_for_ddp` and :func:`gradckpt.apply` (call before wrapping in DDP)."""
    chosen = plan_for_ddp(model, loss_fn, budget, **options)
    apply(model, chosen)
    return chosen


# -------------------------------------------------------------- measurement


class RankMemoryTracker(MemoryTracker):
    """:class:`~gradckpt.measure.MemoryTracker` for one rank of an FSDP2 (or DDP) step.

    ``param_bytes`` counts this rank's shards (DTensor parameters by their local
    tensors) and buffers, and storage resizes count as allocations and frees:
    FSDP2 gathers a group's parameters into storages it resizes up, and frees
    them by resizing to zero, which a dispatch mode does not see. Measure a
    step after the first (FSDP2 creates those storages in the first).

    Example:
        >>> with RankMemoryTracker(model) as mt:
        ...     loss_fn().backward()
        >>> mt.peak_bytes <= budget_per_rank
    """

    def __enter__(self) -> RankMemoryTracker:
        super().__enter__()  # param_bytes: state_bytes counts DTensors by their local shard
        self._resized: dict[int, int] = {}  # storage key -> virtual allocation key
        self._original_resize = torch.UntypedStorage.resize_
        tracker = self
        original = self._original_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            out = original(storage, size)
            after = storage.nbytes()
            if after != before:
                tracker._on_resize(storage._cdata, after)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        super().__exit__(exc_type, exc, tb)

    def _on_resize(self, key: int, nbytes: int) -> None:
        # A storage created in the step and then resized: its creation counted
        # its first size; from now on its resizes count instead.
        if key in self._ids:
            self._on_free(key)
        virtual = self._resized.pop(key, None)
        if virtual is not None:
            self._on_free(virtual)
        if nbytes > 0:
            virtual = -(len(self._events) + 1)  # never a real storage key (those are > 0)
            self._resized[key] = virtual
            self._on_alloc(virtual, nbytes)
