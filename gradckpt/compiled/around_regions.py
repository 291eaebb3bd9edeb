"""torch.compile for planned models: compiled region bodies, the rest compiled around them.

Order, as in torchtitan: **plan/apply, then compile, then FSDP/DDP**::

    gradckpt.fit(model, loss_fn, budget="3GiB")           # 1. plan and apply
    compile_model(model, backend="inductor")               # 2. compile
    fully_shard(...)  # or DDP(model)                      # 3. wrap (integrations.distributed)

Three ways to compile a planned model, all giving the plain model's gradients:

* ``torch.compile(model)`` / ``model.compile()`` / ``block.compile()`` after
  :func:`gradckpt.apply`: correct, but only what lies outside regions compiles.
  Kept units compile into their caller's graph; every region is a graph break
  and runs eagerly in its forward and in its recompute, so both save eager's
  tensors (a region whose forward ran compiled code and whose recompute ran it
  eagerly would save different tensors; see :mod:`gradckpt.engine.dynamo`).
* :func:`compile_model` (this module): also compiles each unit's *body* and
  runs it *inside* its region. The region's forward and its recompute call the
  same compiled callable, so they save the same tensors (the AOT partitioner's
  choice), and the recompute runs compiled code too. What the engine's
  dispatch mode does in an eager recompute is done otherwise: BatchNorm
  running statistics the forward updated are restored after the recompute;
  RNG state is replayed as always (same dropout masks). Selective units stay
  eager (their policy names eager ops by position); so do regions whose
  forward ran under a TorchDispatchMode (Dynamo runs compiled code eagerly
  there, e.g. under ``gradckpt.measure.MemoryTracker``), and their recompute
  then is eager as well.
* per unit only: ``compile_model(model, whole_model=False)``.
* :func:`gradckpt.compile` (:mod:`gradckpt.compiled.in_graph`): no graph
  breaks at regions; the plan's decisions become selective-checkpoint tags
  inside one compiled graph, and the compiler's partitioner executes them.
  :func:`gradckpt.compiled.budget.fit_compiled` holds a byte
  budget measured at the allocator on the compiled step.

Compile after the last ``apply``: applying another plan drops the compiled
bodies (call :func:`compile_model` again).

Limitations: ``fullgraph=True`` applies to unit bodies only (the model's own
graph breaks at every region); plans made before compiling predict eager
memory and time, and compiled bodies save the partitioner's tensors, which
may be fewer or more; early stop saves nothing inside a compiled body (its
saved tensors are all packed when its graph ends).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gradckpt.apply.apply import applied_units, prepare_for_compile, wrap_unit

__all__ = ["compile_model", "compiled_units"]


def compile_model(
    model: nn.Module,
    *,
    whole_model: bool = True,
    units: Iterable[str] | None = None,
    **compile_kwargs: Any,
) -> nn.Module:
    """Compile a planned model in place: unit bodies inside their regions, and the rest.

    Args:
        model: a model :func:`gradckpt.apply` (or ``fit``) installed a plan on;
            without a plan it is simply ``model.compile(**compile_kwargs)``.
        whole_model: also compile the model's own forward (the code between
            units: embeddings sums, loss heads) with ``model.compile``; the
            graph breaks at every region.
        units: paths of the units whose bodies to compile (default: all but
            selective ones, which always run eagerly).
        **compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``,
            ``dynamic``, ``options``, ``fullgraph``; ``fullgraph`` is not passed
            to the whole-model compile, which has graph breaks by design).

    Returns:
        The model (compiled in place).

    Example:
        >>> gradckpt.fit(model, loss_fn, budget=0.5)
        >>> compile_model(model, backend="inductor")
    """
    prepare_for_compile(model)  # regions become graph breaks, not traced wrappers
    installed = applied_units(model)
    wanted = set(units) if units is not None else None
    if wanted is not None:
        unknown = sorted(wanted - set(installed))
        if unknown:
            raise ValueError(f"compile_model: {unknown} are not units of the applied plan")
    for path, spec in installed.items():
        if wanted is not None and path not in wanted:
            continue
        if not spec.handler.compiled_body:
            continue  # e.g. selective: its policy must see every op, so it stays eager
        wrap_unit(model, path)  # a kept unit may run without a wrapper; a compiled body needs one
        spec.compiled = torch.compile(spec.plain, **compile_kwargs)
    if whole_model:
        model.compile(**{k: v for k, v in compile_kwargs.items() if k != "fullgraph"})
    return model


def compiled_units(model: nn.Module) -> list[str]:
    """Paths of the units of ``model`` whose bodies :func:`compile_model` compiled."""
    return [path for path, spec in applied_units(model).items() if spec.compiled is not None]
