"""What a shape guard did: :class:`ShapeStats`, the counts ``gradckpt.shape_stats`` reports.

Example:
    >>> print(gradckpt.shape_stats(model).summary())
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShapeStats"]


@dataclass(frozen=True)
class ShapeStats:
    """What the guard did so far: calls seen, plans held, plans made at runtime, switches.

    Example:
        >>> print(gradckpt.shape_stats(model).summary())
    """

    calls: int
    plans: int
    replans: int
    replan_seconds: tuple[float, ...]
    switches: int
    warnings: int
    policy: str
    active: str
    rescaled: int = 0  # re-plans made from rescaled profiles (no profile at their shape)
    recompiles: int = 0  # torch._dynamo recompiles of a compiled model (gradckpt.compile)
    #: (shape, route) per planned shape: how it got its plan (gradckpt.api.shape_planner.ROUTES)
    routes: tuple[tuple[str, str], ...] = ()

    @property
    def replan_seconds_total(self) -> float:
        return sum(self.replan_seconds)

    def summary(self) -> str:
        """One line, e.g. for a training log."""
        most = max(self.replan_seconds, default=0.0)
        return (
            f"gradckpt shapes: {self.plans} plan(s), {self.replans} planned during training "
            f"in {self.replan_seconds_total:.2f} s (longest {most:.2f} s; {self.rescaled} by "
            f"rescaling), {self.switches} "
            f"switch(es) over {self.calls} guarded call(s), {self.warnings} warning(s), "
            f"{self.recompiles} torch._dynamo recompile(s); "
            f"policy {self.policy}; active shape {self.active}"
        )
