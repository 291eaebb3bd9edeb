"""Layer 2: stock per-op policies, all plain callables in one namespace.

A policy is ``policy(ctx, op, *args, **kwargs) -> SAVE | RECOMPUTE``, asked once
per ATen op of a checkpointed region during the forward pass (see
:class:`gradckpt.PolicyContext`). Factories validate their arguments eagerly.

Example:
    >>> from gradckpt import policies
    >>> y = gradckpt.checkpoint(block, x, policy=policies.save_matmuls)
    >>> y = gradckpt.checkpoint(block, x, policy=policies.either(
    ...     policies.save_matmuls, policies.save_names("attn_out")))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradckpt.engine.decisions import RECOMPUTE, SAVE, TAG, Decision, PolicyContext, as_decision

__all__ = [
    "MATMUL_OPS",
    "Policy",
    "either",
    "explain",
    "recompute_all",
    "save_all",
    "save_indices",
    "save_matmuls",
    "save_names",
    "save_ops",
]

Policy = Callable[..., Any]
aten = torch.ops.aten


def _optional_ops(*names: str) -> list[Any]:
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return found


#: Ops whose outputs :func:`save_matmuls` keeps: the compute-heavy ones that are
#: expensive to redo and cheap to store relative to their cost.
MATMUL_OPS: frozenset[Any] = frozenset(
    _optional_ops(
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
)


def save_all(ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    """Keep every op's output: nothing is recomputed (checkpointing's memory, none of its saving)."""
    return SAVE


def recompute_all(ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    """Keep nothing inside the region: the whole region is recomputed (plain checkpointing)."""
    return RECOMPUTE


def save_matmuls(ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    """Keep matmul, convolution and fused-attention outputs; recompute norms and pointwise ops."""
    return SAVE if op in MATMUL_OPS else RECOMPUTE


def save_ops(*ops: Any) -> Policy:
    """Keep the outputs of the given ATen ops (overloads such as ``aten.mm.default``).

    Example:
        >>> policy = save_ops(torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    """
    chosen = frozenset(ops)
    for op in chosen:
        if isinstance(op, torch._ops.OpOverloadPacket):
            raise ValueError(
                f"save_ops needs op overloads, got the packet {op}; write {op}.default "
                "(or the overload you mean)"
            )
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"save_ops takes ATen op overloads, got {op!r}")

    def policy(ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return SAVE if op in chosen else RECOMPUTE

    policy.__name__ = f"save_ops({', '.join(sorted(str(o) for o in chosen))})"
    return policy


def save_names(*names: str) -> Policy:
    """Keep tensors named with :func:`gradckpt.tag` under one of ``names``.

    Example:
        >>> policy = save_names("attn_out", "mlp_hidden")
    """
    if not names:
        raise ValueError("save_names needs at least one name")
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"save_names takes non-empty strings, got {name!r}")
    chosen = frozenset(names)

    def policy(ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return SAVE if op is TAG and args[1] in chosen else RECOMPUTE

    policy.__name__ = f"save_names({', '.join(sorted(chosen))})"
    return policy


def save_indices(indices: Iterable[int]) -> Policy:
    """Keep the ops at the given positions of the region (how plans name ops).

    Example:
        >>> policy = save_indices([0, 4, 9])
    """
    chosen = frozenset(indices)
    for index in chosen:
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"save_indices takes non-negative op positions, got {index!r}")

    def policy(ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return SAVE if ctx.index in chosen else RECOMPUTE

    policy.__name__ = f"save_indices({len(chosen)} ops)"
    return policy


def either(*policies: Policy) -> Policy:
    """Keep an op's output if any of the policies keeps it (JAX's save_from_both_policies).

    Example:
        >>> policy = either(save_matmuls, save_names("attn_out"))
    """
    if len(policies) < 2:
        raise ValueError("either needs at least two policies")
    for p in policies:
        if not callable(p):
            raise TypeError(f"either takes policies (callables), got {p!r}")

    def policy(ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        for p in policies:
            if as_decision(p(ctx, op, *args, **kwargs), op, p) is SAVE:
                return SAVE
        return RECOMPUTE

    policy.__name__ = "either(" + ", ".join(getattr(p, "__name__", repr(p)) for p in policies) + ")"
    return policy


def explain(policy: Policy, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[dict]:
    """What ``policy`` keeps when ``fn(*args, **kwargs)`` is checkpointed with it.

    Returns one row per op of the region: index, op name, decision, output
    shapes and bytes (like JAX's ``print_saved_residuals``). Runs ``fn`` once.

    Example:
        >>> for row in policies.explain(policies.save_matmuls, block, x):
        ...     print(row["index"], row["op"], row["decision"], row["bytes"])
    """
    from gradckpt.engine.checkpoint import checkpoint

    rows: list[dict] = []
    made_by: dict[int, tuple[torch.Tensor, dict]] = {}  # id(output) -> (output, its row)

    def recording(ctx: PolicyContext, op: Any, *op_args: Any, **op_kwargs: Any) -> Decision:
        decision = as_decision(policy(ctx, op, *op_args, **op_kwargs), op, policy)
        if op is TAG:
            # As the engine does: a kept tag keeps the (non-view) op that made the
            # tensor, or its base when the tensor is a view.
            tensor = op_args[0]
            for t in (tensor, tensor._base):
                found = made_by.get(id(t)) if t is not None else None
                if found is not None and found[0] is t:
                    if decision is SAVE:
                        found[1]["decision"] = "save"
                    break
            return decision
        out = ctx.output
        flat = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        is_view = getattr(op, "is_view", False)  # the engine never keeps views: free to redo
        rows.append(
            {
                "index": ctx.index,
                "op": str(op),
                "decision": "save" if decision is SAVE and not is_view else "recompute",
                "shapes": [tuple(t.shape) for t in tensors],
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
            }
        )
        if not is_view:
            for t in tensors:
                made_by[id(t)] = (t, rows[-1])
        return decision

    with torch.enable_grad():
        checkpoint(fn, *args, policy=recording, **kwargs)
    return [row for row in rows if row["index"] >= 0]
