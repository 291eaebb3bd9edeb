"""What ``plan`` and ``fit`` hand down: their planning options and their shape options, checked.

Example:
    >>> options = PlanOptions(solver="dp", repeats=3)
    >>> handling = ShapeHandling(on_new_shape="warn", seq_dim=1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradckpt.api.model_calls import LossFrom
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.solving.solvers import Solver
from gradckpt.profiling.records import Profile
from gradckpt.profiling.training_step import TrainingStep
from gradckpt.profiling.units import BlockSpec

__all__ = ["LossFn", "PlanOptions", "ShapeHandling"]

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
class ShapeHandling:
    """What ``fit`` does with calls at shapes other than the fitted one (its shape options,
    checked): they travel together from ``fit``/``plan`` to the shape planner and the guard."""

    on_new_shape: str = "replan"
    loss_from: LossFrom | None = None
    round_up: bool = False
    seq_dim: int = 1
    rescale: bool = True
