"""What a budget means to the verbs: the whole training step, the device, and planning within it.

* ``optimizer=``, ``accumulation_steps=``, ``set_to_none=`` become a
  :class:`~gradckpt.profiling.training_step.TrainingStep` (the optimizer's memory
  predicted on fake tensors, :mod:`gradckpt.measure.optimizer`), folded into the
  profile (:mod:`gradckpt.planning.solving.whole_step`).
* ``budget="auto"`` becomes bytes from the device the model is on
  (:mod:`gradckpt.measure.device`), logged with its rule.
* **Planning never runs the step above a byte budget.** The step is first
  profiled under fake tensors (nothing allocated). Only if what profiling runs,
  one micro-batch's plain forward and backward beside the gradients and
  optimizer state that already exist, fits the budget with :data:`PLAIN_MARGIN`
  to spare is it profiled for real, as before. Otherwise the plan is made from the fake profile (op times
  estimated from FLOPs and bytes) and checked by running plans that fit, the
  leanest first (:mod:`gradckpt.apply.frugal`). If the step cannot run under
  fake tensors, gradckpt warns and profiles the plain step for real: the one
  route that may exceed the budget, said so when it happens. A real profile
  under a byte budget bounds what the CPU malloc probe holds to what the budget
  leaves beside the step (:func:`~gradckpt.measure.outside.held_at_most`). A fraction budget
  (``0.5``, ``"50%"``) is relative to the plain peak, which then has to be
  measured: the plain step is profiled for real.

Same layer as :mod:`gradckpt.api`, whose verbs call these.

Example:
    >>> step = training_step(model, torch.optim.AdamW(model.parameters()), 4, True)
    >>> budget, device = resolve_budget(model, "auto", step)
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gradckpt.measure.beside import malloc_in_use, tracker_bytes
from gradckpt.measure.device import DeviceMemory, device_memory
from gradckpt.measure.memory import format_bytes, storage_sizes
from gradckpt.measure.optimizer import optimizer_memory, optimizer_state_sizes
from gradckpt.measure.outside import held_at_most
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.solving.budget import Budget, BudgetError
from gradckpt.planning.solving.replayed import with_replayed
from gradckpt.planning.solving.solvers import Solver
from gradckpt.planning.solving.whole_step import check_floor, with_training_step
from gradckpt.profiling.records import Profile
from gradckpt.profiling.replay import SpecSink, capturing_specs, replay_ops
from gradckpt.profiling.run import profile as profile_step
from gradckpt.profiling.training_step import TrainingStep
from gradckpt.profiling.units import BlockSpec

__all__ = [
    "PLAIN_MARGIN",
    "annotated",
    "budget_and_step",
    "budget_profile",
    "check_step_arguments",
    "held_bytes",
    "holds_beside",
    "plan_beside",
    "resident_bytes",
    "resolve_budget",
    "resolved_budget",
    "training_step",
    "with_real_kernels",
]

logger = logging.getLogger("gradckpt")

#: The plain step is profiled for real only when its fake-profiled whole-step peak
#: is this share under the budget: fake profiles count no kernel workspace (measured
#: up to 10-15% of the peak on conv models, well under 1% on transformers).
PLAIN_MARGIN = 0.15


def check_step_arguments(
    optimizer: object, accumulation_steps: object, set_to_none: object
) -> None:
    """Refuse bad whole-step arguments before anything is profiled."""
    TrainingStep(None, accumulation_steps, set_to_none)  # type: ignore[arg-type]
    if optimizer is not None and isinstance(optimizer, (int, float, bool)):
        raise TypeError(
            f"optimizer= takes a torch.optim.Optimizer, a class (with kwargs as (cls, kwargs)) "
            f"or a name such as 'adamw'; got {optimizer!r}"
        )


def training_step(
    model: nn.Module, optimizer: Any, accumulation_steps: int, set_to_none: bool
) -> TrainingStep | None:
    """The step to fold into profiles (None: one micro-batch, nothing more counted).

    Example:
        >>> training_step(model, "adamw", 1, True).optimizer.state_bytes
    """
    check_step_arguments(optimizer, accumulation_steps, set_to_none)
    if optimizer is None and accumulation_steps == 1 and set_to_none:
        return None
    memory = optimizer_memory(model, optimizer) if optimizer is not None else None
    return TrainingStep(memory, accumulation_steps, set_to_none)


def budget_and_step(
    model: nn.Module, budget: Budget, optimizer: Any, accumulation: int, to_none: bool
) -> Budget:
    """``budget`` (read by the verb) resolved: bytes or a fraction ("auto" read from the
    device, its reading kept) and the training step it holds.

    Example:
        >>> budget = budget_and_step(model, Budget.read("auto"), "adamw", 4, True)
        >>> budget.value, budget.device.line(), budget.step
    """
    step = training_step(model, optimizer, accumulation, to_none)
    resolved = resolved_budget(model, budget, optimizer)
    if resolved.device is not None and step is None:
        step = TrainingStep()  # the breakdown shows the device's rule, and what is not counted
    return replace(resolved, step=step)


def held_bytes(model: nn.Module, optimizer: Any) -> int:
    """Gradients and a live optimizer's state that exist already (besides parameters).

    Example:
        >>> held_bytes(model, opt)  # 0 before the first backward and step
    """
    return resident_bytes(model, optimizer) - sum(
        storage_sizes([*model.parameters(), *model.buffers()]).values()
    )


def resident_bytes(model: nn.Module, optimizer: Any = None, others: Any = ()) -> int:
    """Bytes resident now that a training step holds throughout (each storage once): the
    parameters, buffers and gradients of ``model`` and of ``others`` (modules such as a
    reference model), and a live ``optimizer``'s state.

    Example:
        >>> resident_bytes(model, opt)  # after a step: params + grads + AdamW's two moments
    """
    modules = [model, *others]
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    sizes = storage_sizes(tensors)
    if isinstance(optimizer, torch.optim.Optimizer):
        sizes.update(optimizer_state_sizes(optimizer))  # the same storage keys
    return sum(sizes.values())


def resolve_budget(
    model: nn.Module, budget: int | float | str, optimizer: Any = None
) -> tuple[int | float | str, DeviceMemory | None]:
    """``budget`` as the planner takes it: ``"auto"`` becomes the device's bytes (logged).

    Raises BudgetError when the parameters and the optimizer's state alone do
    not fit the device.

    Example:
        >>> resolve_budget(model, "auto")[0] > 0
        True
    """
    resolved = resolved_budget(model, Budget.read(budget), optimizer)
    return (budget, None) if resolved.device is None else (int(resolved.value), resolved.device)


def resolved_budget(model: nn.Module, budget: Budget, optimizer: Any = None) -> Budget:
    """``budget`` with ``"auto"`` made the bytes of the device the model is on (logged;
    the reading kept as ``device``); any other budget as it is.

    Example:
        >>> resolved_budget(model, Budget.read("auto")).kind
        'bytes'
    """
    if budget.kind != "device":
        return budget
    where = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = device_memory(where, held_bytes=resident_bytes(model, optimizer))
    logger.info("gradckpt: %s", device.line())
    return replace(budget, kind="bytes", value=device.budget_bytes, device=device)


def budget_profile(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    budget: Budget,
    step: TrainingStep | None,
    *,
    blocks: BlockSpec = None,
    repeats: int = 3,
    held_bytes: int = 0,
) -> tuple[Profile, Profile | None]:
    """The profile to plan from, and (frugal route) the raw fake profile it came from.

    See the module docstring. The second value is None when the plain step was
    profiled for real (it fits, or the budget is a fraction, or fake tensors failed).
    What profiling runs is one micro-batch's plain forward and backward, with
    ``held_bytes`` (gradients and optimizer state that already exist:
    :func:`held_bytes`) beside it: that, not the whole step, is what must fit.

    Example:
        >>> prof, fake = budget_profile(model, loss_fn, Budget.read(300 << 20), None)
    """

    def real(room: int | None = None) -> Profile:
        with held_at_most(room):
            prof = profile_step(model, loss_fn, blocks=blocks, repeats=repeats)
        return with_training_step(prof, step)

    if budget.kind != "bytes":
        return real(), None
    value = budget.value
    try:
        # A step that reads a value (a logged loss.item()) gets placeholders: the plan
        # made from it is checked on real steps (gradckpt.apply.frugal).
        with capturing_specs(model) as specs:
            raw = profile_step(model, loss_fn, blocks=blocks, fake=True, answer_scalars=True)
    except Exception as exc:  # a model that cannot run under fake tensors
        warnings.warn(
            f"gradckpt: could not profile {type(model).__name__} under fake tensors "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "profiling the plain step for real, which may peak above the budget while planning",
            stacklevel=3,
        )
        return real(), None
    check_floor(with_training_step(raw, step), int(value))  # before anything runs for real
    # Each distinct op once, alone: the plain peak with its kernels' workspace (a
    # U-Net's is 26% over its tensors'), before deciding whether the plain step fits.
    raw = with_real_kernels(model, raw, specs, int(value) - raw.param_bytes - held_bytes)
    profiled = (raw.measured_peak_bytes + held_bytes) * (1 + PLAIN_MARGIN)
    if profiled <= value:
        # The malloc probe's held heap chunks (gradckpt.measure.outside) get what the
        # budget leaves beside the step and its margin, no more.
        return real(int(value - profiled)), None
    fake = with_training_step(raw, step)
    logger.info(
        "gradckpt: the plain step (%s predicted) may not fit the budget of %s: planning "
        "from fake tensors, checking on steps that run under a plan",
        format_bytes(fake.measured_peak_bytes), format_bytes(int(value)),
    )  # fmt: skip
    return fake, raw


def holds_beside(budget: Budget, at_malloc: bool) -> bool:
    """Whether ``budget`` also holds what malloc takes beside the step's tensors: a byte
    budget counted at malloc's level does; a fraction of the plain (tensors') peak does not.

    Example:
        >>> holds_beside(Budget.read("300MiB"), at_malloc=True)
        True
    """
    return at_malloc and not budget.is_fraction


def plan_beside(
    planner: Planner,
    budget: Budget,
    budget_bytes: int,
    solver: str | Solver,
    since: int | None = None,
    at_malloc: bool = True,
) -> Plan:
    """The plan for ``budget`` (``budget_bytes`` in bytes) less what the step holds
    beside its tensors, and what planning holds meanwhile.

    Autograd's graph and the step's Python objects come from malloc too
    (``Profile.beside_bytes``: 64 KiB on a 106-op ResNet step, 190 KiB on a 620-op
    GPT, 1.3 MiB on a small Mamba's scan), and so do planning's own objects while
    its checks run (the profiles, the specs of a fake one: what malloc holds now
    above ``since``, :func:`~gradckpt.measure.beside.malloc_in_use` when planning
    began). A byte budget counted at malloc's level holds them, so the tensors are
    planned for what is left. A fraction of the plain peak is of the tensors' peak:
    nothing is taken off; nor with ``at_malloc=False`` (offload: on the CPU, the host
    memory it moves tensors to is malloc's too). The plan's ``budget_bytes`` is the
    share planned for; the caller puts the whole budget back once its candidates are
    chosen.

    Example:
        >>> plan_beside(planner, Budget.read("300MiB"), 300 << 20, "dp", since).budget_bytes
    """
    beside = 0
    if holds_beside(budget, at_malloc):
        if since is not None:
            gc.collect()  # garbage would read as planning's own
        now = malloc_in_use() if since is not None else None
        beside = planner.profile.beside_bytes + (max(0, now - since) if now is not None else 0)
    try:
        # max(1, ...): a budget all beside its tensors is refused with the least that fits.
        return planner.plan(max(1, budget_bytes - beside), solver)
    except BudgetError as exc:
        least = exc.least_peak_bytes
        if not beside or least is None:
            raise
        planned = f"the budget of {format_bytes(max(1, budget_bytes - beside))}"
        whole = (
            f"the budget of {format_bytes(budget_bytes)} (less {format_bytes(beside)} held "
            "from malloc beside the step's tensors: autograd's graph, Python objects, "
            "planning's own)"
        )
        raise BudgetError(
            f"{str(exc).replace(planned, whole, 1)} The least budget that fits is "
            f"{format_bytes(least + beside, round_up=True)}.",
            least_peak_bytes=least + beside,
        ) from exc


def with_real_kernels(model: nn.Module, raw: Profile, specs: SpecSink, room: int) -> Profile:
    """The fake profile ``raw`` with its ops' workspace and times from real runs of each
    distinct op (:mod:`gradckpt.profiling.replay`), on ops whose run holds at most
    ``room`` bytes. A model with parameters on the meta device is left as it is.

    Example:
        >>> with capturing_specs(model) as specs:
        ...     raw = profile_step(model, loss_fn, fake=True)
        >>> planned = with_real_kernels(model, raw, specs, budget - raw.param_bytes)
    """
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return raw  # no real tensors to run with: the estimates stay
    replayed = replay_ops(raw, specs.plain(), model, room)
    logger.info(
        "gradckpt: ran %d ops of the fake profile for real (%d not run): workspace %s at most",
        len(replayed.readings), len(raw.ops) - len(replayed.readings),
        format_bytes(max((r.workspace for r in replayed.readings.values()), default=0)),
    )  # fmt: skip
    # Plans from it are checked on steps measured under the allocator's events, whose
    # own records malloc holds too (an event per allocation and free, and per moment the
    # check reads, gradckpt.measure.beside.BesideReading): counted beside.
    measuring = tracker_bytes(2 * (len(raw.storages) + len(raw.ops)))
    return replace(with_replayed(raw, replayed), beside_bytes=raw.beside_bytes + measuring)


def annotated(plan: Plan, device: DeviceMemory | None) -> Plan:
    """``plan`` with the auto budget's headroom and rule in its breakdown.

    Example:
        >>> annotated(plan, device_memory("cpu")).step.headroom > 0
        True
    """
    if device is None or plan.step is None:
        return plan
    return replace(
        plan, step=replace(plan.step, headroom=device.headroom_bytes, budget_rule=device.rule)
    )
