"""Stages traced by ``torch.distributed.pipelining.pipeline()`` (``SplitPoint``): their blocks.

``pipeline(model, mb_args, split_spec={...: SplitPoint.BEGINNING})`` exports the
model and cuts its graph into one ``GraphModule`` per stage, whose submodules
keep the model's paths (``blocks.2``, ``blocks.2.attn``, ...) but are all of
one class, ``InterpreterModule``. gradckpt's block discovery looks for a
repeated module class, so in a traced stage it finds none that means anything
(it took ``norm`` and ``lm_head`` for a stage's blocks). The stage's own graph
says which submodules it calls: the numbered children of one container
(``blocks.2``, ``blocks.3``) are its blocks, and :func:`traced_block_paths`
reads them, for :func:`~gradckpt.integrations.pipeline.plan_stage` to pass as
``blocks=`` when none is given.

Example:
    >>> pipe = pipeline(model, (x_mb,), split_spec={"blocks.2": SplitPoint.BEGINNING})
    >>> traced_block_paths(pipe.get_stage_module(1))
    ['blocks.2', 'blocks.3']
"""

from __future__ import annotations

import re
from collections import defaultdict

from torch import nn

__all__ = ["traced_block_paths"]

_NUMBERED = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")


def traced_block_paths(module: nn.Module) -> list[str] | None:
    """The blocks a traced stage calls: the numbered children its graph calls of the container
    with the most of them, in call order; None for a module that is not a traced graph
    or calls no numbered child (then blocks are discovered as for any model).

    Example:
        >>> traced_block_paths(nn.Linear(2, 2)) is None
        True
    """
    graph = getattr(module, "graph", None)
    if graph is None or not hasattr(graph, "nodes"):
        return None
    by_container: dict[str, list[str]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        match = _NUMBERED.match(str(node.target))
        if match and str(node.target) not in by_container[match["container"]]:
            by_container[match["container"]].append(str(node.target))
    if not by_container:
        return None
    return max(by_container.values(), key=len)
