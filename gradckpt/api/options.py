"""The options of ``plan`` and ``fit``, grouped as a person thinks of them, and what they hand down.

A user passes :class:`ShapeOptions` (new shapes), :class:`ProfileOptions` (how the
step is profiled) and :class:`StepOptions` (the training step the budget holds);
the verbs check them and hand :class:`PlanOptions` and the shape options down.

Example:
    >>> gradckpt.fit(model, loss_fn, "3GiB", shapes=ShapeOptions([256, 512]),
    ...              profiling=ProfileOptions(repeats=1), step=StepOptions("adamw"))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradckpt.api.model_calls import LossFrom
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.solving.solvers import Solver
from gradckpt.profiling.records import Profile
from gradckpt.profiling.training_step import TrainingStep
from gradckpt.profiling.units import BlockSpec

__all__ = ["LossFn", "PlanOptions", "ProfileOptions", "ShapeOptions", "StepOptions"]

#: ``loss_fn``: one forward on a representative batch, returning the scalar loss.
LossFn = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class PlanOptions:
    """The planning options ``plan`` and ``fit`` share (already checked)."""

    blocks: BlockSpec = None
    solver: str | Solver = "dp"
    repeats: int = 3
    profile: Profile | None = None
    segments: bool = True
    offload: OffloadOptions | None = None
    #: The training step around forward/backward that the budget also holds.
    step: TrainingStep | None = None
    #: Gradients and optimizer state that exist already (beside a real profile's step).
    held_bytes: int = 0
    #: Whether plans may chunk the head and its loss (``Chunk``); False: bit for bit plain.
    chunking: bool = True


@dataclass(frozen=True)
class ShapeOptions:
    """Everything about input shapes other than the one ``loss_fn`` runs (``shapes=``).

    Args:
        planned: shapes to plan now: sequence lengths (``seq_dim`` resized), or example
            inputs (dicts of keyword inputs, tuples of positional ones); each is
            profiled under fake tensors (:mod:`gradckpt.api.shape_planner`).
        on_new_shape: (``fit``) what a call at a shape without a plan does:
            ``"replan"`` (plan it before it runs, under the same budget in bytes),
            ``"warn"`` (run the old plan, warning once) or ``"error"`` (``ShapeError``).
        loss_from: ``(output, *args, **kwargs) -> loss``: how a model call becomes the
            training loss at a new shape (default: ``output.loss`` if the output has
            one, else the sum of its floating tensors).
        round_up: (``fit``) a call bounded in every dimension by a planned shape runs
            under the smallest such plan instead of being planned (for models whose
            peak is monotone in the input shape).
        seq_dim: the sequence dimension: integer ``planned`` shapes resize it, and a
            call that changes only it is planned by rescaling.
        rescale: (``fit``) plan a call that changes only the sequence length from
            profiles at four lengths rescaled exactly; False profiles every new shape.

    Example:
        >>> gradckpt.fit(model, loss_fn, "3GiB", shapes=ShapeOptions([256, 512], round_up=True))
    """

    planned: Sequence[Any] | None = None
    on_new_shape: str = "replan"
    loss_from: LossFrom | None = None
    round_up: bool = False
    seq_dim: int = 1
    rescale: bool = True


@dataclass(frozen=True)
class ProfileOptions:
    """How the step is profiled (``profiling=``).

    Args:
        blocks: the repeated blocks (module paths, or a predicate ``(path, module) ->
            bool``); found automatically if None.
        repeats: profiled steps to take median op times from.
        profile: a profile from ``gradckpt.profile(...)`` to plan from instead of measuring.

    Example:
        >>> gradckpt.plan(model, loss_fn, "3GiB", profiling=ProfileOptions(repeats=1))
    """

    blocks: BlockSpec = None
    repeats: int = 3
    profile: Profile | None = None


@dataclass(frozen=True)
class StepOptions:
    """The whole training step the budget holds beside forward and backward (``step=``).

    Args:
        optimizer: a live ``torch.optim.Optimizer``, a class or ``(class, kwargs)``, or a
            name ("adamw", "sgd", ...); its state and ``step()`` temporaries are predicted
            on fake tensors. None: not counted (the summary says so).
        accumulation_steps: micro-batches per optimizer step; from the second on the
            gradients are resident through forward and backward.
        set_to_none: False when gradients are zeroed in place (resident always).

    Example:
        >>> gradckpt.fit(model, loss_fn, "auto", step=StepOptions(opt, accumulation_steps=4))
    """

    optimizer: Any = None
    accumulation_steps: int = 1
    set_to_none: bool = True
