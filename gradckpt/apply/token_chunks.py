"""MLPs in slices of tokens: the forwards ``apply`` installs for ``Plan.token_chunks``.

Each module a plan names (``(path, k)``) gets a
:class:`~gradckpt.engine.chunking.token_wise.TokenChunkedForward` over its own
forward; ``apply`` installs and ``remove`` restores them with the units' wrappers.
Only a kept or recomputed block's MLP may run in slices: a selective block's policy
counts its region's ops, and an offloaded one's saved tensors move as a whole.
"""

from __future__ import annotations

from torch import nn

from gradckpt.engine.chunking.token_wise import TokenChunkedForward
from gradckpt.engine.decisions import Keep, Recompute
from gradckpt.planning.plans.plan import Plan
from gradckpt.profiling.units import module_path

__all__ = ["token_chunked_forwards"]


def token_chunked_forwards(
    model: nn.Module, plan: Plan
) -> list[tuple[nn.Module, TokenChunkedForward]]:
    """The chunked forward to install on each module ``plan.token_chunks`` names.

    ``apply`` checked that the model has every module named. Raises ValueError for one
    inside a block that is neither kept nor recomputed.

    Example:
        >>> [(m, f.chunks) for m, f in token_chunked_forwards(model, plan)]
    """
    modules = dict(model.named_modules())
    decisions = {module_path(u.path): u.decision for u in plan.units}
    out = []
    for path, chunks in plan.token_chunks:
        module = modules[path]
        block = max((b for b in decisions if path.startswith(b + ".")), key=len, default=None)
        decision = decisions.get(block) if block is not None else None
        if not isinstance(decision, (Keep, Recompute)):
            # A selective policy counts its region's ops, and slices would add to them.
            raise ValueError(
                f"the plan chunks {path!r} along the tokens inside "
                f"{block or 'no unit'} ({decision.kind if decision else 'unplanned'}); only a "
                "kept or recomputed block's MLP runs in slices. Plan again."
            )
        plain = getattr(module.forward, "__gradckpt_original__", module.forward)
        # The planner chunks only modules that draw no random numbers (token_wise).
        out.append((module, TokenChunkedForward(plain, chunks, name=path, deferrable=True)))
    return out
