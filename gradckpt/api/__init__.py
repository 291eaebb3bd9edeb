"""The API layer: the verbs users call, and what they need to hand the layers below.

``profile``, ``plan``, ``frontier`` and ``explain`` are in :mod:`~gradckpt.api.verbs`,
``fit`` in :mod:`~gradckpt.api.fitting`. Below them, each in its own module:

* :mod:`~gradckpt.api.checks`: arguments refused in the user's terms, before profiling;
* :mod:`~gradckpt.api.options`: the options grouped (:class:`ShapeOptions`,
  :class:`ProfileOptions`, :class:`StepOptions`) and what is handed down;
* :mod:`~gradckpt.api.old_keywords`: the keywords the groups replaced, for one release;
* :mod:`~gradckpt.api.budget`: what a budget means (the whole step, the device,
  planning without running the step above it);
* :mod:`~gradckpt.api.fitted`: the plan for ``loss_fn``'s step and the model call it makes;
* :mod:`~gradckpt.api.model_calls`: model calls recorded and remade at other shapes;
* :mod:`~gradckpt.api.shape_planner`: a plan per new shape, by the first route that works;
* :mod:`~gradckpt.api.shapes`: the shape planner ``fit`` builds and the guard it installs.

Example:
    >>> from gradckpt.api import fit, plan
    >>> p = plan(model, loss_fn, "3GiB")
"""

from gradckpt.api.fitting import fit
from gradckpt.api.options import ProfileOptions, ShapeOptions, StepOptions
from gradckpt.api.verbs import FrontierPoint, explain, frontier, plan, profile

__all__ = [
    "FrontierPoint",
    "ProfileOptions",
    "ShapeOptions",
    "StepOptions",
    "explain",
    "fit",
    "frontier",
    "plan",
    "profile",
]
