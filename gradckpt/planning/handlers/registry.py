"""The registry of decision kinds: what each kind does in the planner and at run time.

Every decision kind (:class:`~gradckpt.engine.decisions.Keep`, ``Recompute``,
``Selective``, ``Offload``) has one :class:`KindHandler`,
registered from the kind's own module in :mod:`gradckpt.planning.kinds`. The
generic code asks the handler of a unit's decision instead of comparing kind
names:

* the chain builder (:mod:`gradckpt.planning.solving.chain`): which options a unit offers
  the DP, what each holds between forward and backward, what it recomputes;
* the engine-cost model (:mod:`gradckpt.planning.simulation.costs`): its engine events;
* the simulator (:mod:`gradckpt.planning.simulation.simulate`): the region it opens, if any,
  and the plan-wide effect of all its units (:meth:`KindHandler.plan_effect`);
* the runtime (:mod:`gradckpt.apply`): its per-op policy, whether a compiled
  body may run it, and how its wrapper runs it;
* the summaries: how it reads.

This module imports nothing of the planner but the values its hooks exchange
(:mod:`gradckpt.planning.handlers`), so every planner module can import it. The
built-in kinds register when :mod:`gradckpt.planning` is imported (its
``__init__`` imports :mod:`gradckpt.planning.kinds`, above everything that
dispatches here), so they are in place before any lookup. The pattern is
torchao's handler registry.

Example:
    >>> handler_for(Recompute()).opens_region
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from gradckpt.engine.decisions import Decision
from gradckpt.planning.handlers.engine_counts import EngineCounts

if TYPE_CHECKING:
    from gradckpt.planning.handlers.effects import StepEffect
    from gradckpt.planning.handlers.lookup import Lookup
    from gradckpt.planning.handlers.region import Region
    from gradckpt.profiling.records import Profile, UnitRecord

__all__ = ["KindHandler", "forget", "handler_for", "handlers", "register"]

_HANDLERS: dict[type[Decision], KindHandler] = {}


class KindHandler:
    """What one decision kind does in each layer; subclass it in the kind's module.

    Set :attr:`decision` to the kind's Decision class and override what differs
    from keeping (the defaults describe a unit that runs plainly). A kind that
    opens a region usually extends ``RecomputeHandler``
    (:mod:`gradckpt.planning.kinds.recompute`).
    """

    #: The Decision subclass this handler carries out.
    decision: ClassVar[type[Decision]]
    #: True if a unit with this decision runs inside its own checkpointed region.
    opens_region: ClassVar[bool] = False
    #: True if a torch.compile'd body may stand in for the unit's forward (False when
    #: a per-op policy must see every op eagerly).
    compiled_body: ClassVar[bool] = True
    #: False if the DP must never choose this kind inside a segment's recompute (where
    #: the unit runs again during backward: offloading there would be pointless).
    nested: ClassVar[bool] = True
    #: Kinds whose units share one :meth:`install` result per applied plan (e.g. one
    #: offload session for every unit that moves bytes to host); None: its own.
    runtime_group: ClassVar[type[Decision] | None] = None

    # ----------------------------------------------------------------- planner

    def stage_options(self, profile: Profile, unit: UnitRecord, look: Lookup) -> list[Decision]:
        """Decisions of this kind the DP may choose for ``unit`` (none: the kind is not planned)."""
        return []

    def option_name(self, decision: Decision, index: int) -> str:
        """The DP option's name (``index``: its position among the unit's options)."""
        return decision.kind

    def kept_storages(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> set[int]:
        """Storages made by ``unit`` that stay on the device from its forward to its backward."""
        return set()

    def released_input_bytes(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> int:
        """Bytes of the unit's input that leave the device from its forward to its backward
        (offloaded; the chain otherwise counts a unit's input as held by the unit before)."""
        return 0

    def recompute_seconds(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> float:
        """Op seconds the unit's backward reruns under ``decision``."""
        return 0.0

    def engine_counts(self, profile: Profile, unit: UnitRecord, decision: Decision) -> EngineCounts:
        """Engine events (regions, hooks, policy calls) of the unit run as ``decision``."""
        return EngineCounts()

    def region(self, profile: Profile, unit: UnitRecord, decision: Decision) -> Region | None:
        """The simulator's region for the unit (None: it runs plainly)."""
        return None

    def plan_effect(self, profile: Profile, plan: Any) -> StepEffect | None:
        """What this kind's units of ``plan`` (a :class:`~gradckpt.planning.plans.plan.Plan`)
        do to the simulated step together (None: nothing beyond their regions).

        Called once per simulation for each kind the plan uses. A kind whose units
        interact (a stash, a copy queue) says here what leaves or joins the device
        and what compute waits for; ``Offload``'s is the example.
        """
        return None

    # ----------------------------------------------------------------- runtime

    def install(self, plan: Any) -> Any:
        """State shared by all units of this kind while ``plan`` is applied, or None.

        Called once per applied plan that has units of this kind, before the
        model is touched; every such unit's spec gets the result as ``runtime``
        (e.g. one transfer session for all offloaded units of a model). It lives
        on the model, so it must copy and pickle with it.
        """
        return None

    def policy(self, path: str, decision: Decision) -> Callable[..., Any] | None:
        """The per-op policy the unit's region runs with (None: recompute every op)."""
        return None

    def run(self, unit: Any, args: tuple, kwargs: dict, *, in_recompute: bool) -> Any:
        """Run the unit's forward (``unit``: the apply layer's ``UnitSpec``).

        ``in_recompute``: called while a segment's recompute reruns this unit,
        which must run the way the segment's forward ran it.
        """
        raise NotImplementedError(f"{type(self).__name__}.run")

    # ----------------------------------------------------------------- reading

    def describe(self, decision: Decision) -> str:
        """The decision in a plan summary's unit line."""
        return decision.kind

    def explain(self, decision: Decision) -> str:
        """The decision in ``gradckpt explain``'s per-unit column."""
        return decision.kind


def register(handler: KindHandler) -> KindHandler:
    """Make ``handler`` the one for its decision class (replacing an earlier one).

    Example:
        >>> register(ToyHandler())
    """
    cls = getattr(handler, "decision", None)
    if not (isinstance(cls, type) and issubclass(cls, Decision)):
        raise TypeError(f"{type(handler).__name__}.decision must be a Decision subclass")
    _HANDLERS[cls] = handler
    return handler


def forget(cls: type[Decision]) -> None:
    """Unregister the handler of ``cls`` (tests that register a toy kind clean up with this)."""
    _HANDLERS.pop(cls, None)


def handler_for(decision: Decision | type[Decision]) -> KindHandler:
    """The handler of ``decision`` (an instance or its class); a clear error if none.

    Example:
        >>> handler_for(unit_choice.decision).region(profile, unit, unit_choice.decision)
    """
    cls = decision if isinstance(decision, type) else type(decision)
    found = _HANDLERS.get(cls)
    if found is not None:
        return found
    if not (isinstance(cls, type) and issubclass(cls, Decision)):
        raise TypeError(f"not a gradckpt decision: {decision!r}")
    if cls.unavailable:
        raise NotImplementedError(f"a plan decides {cls.kind!r} for a unit: {cls.unavailable}")
    raise LookupError(
        f"no handler is registered for {cls.kind or cls.__name__!r} decisions; a decision kind "
        "registers one with gradckpt.planning.handlers.registry.register (see gradckpt.planning.kinds)"
    )


def handlers() -> Iterator[KindHandler]:
    """Every registered handler, in registration order (keep and recompute first)."""
    yield from list(_HANDLERS.values())
