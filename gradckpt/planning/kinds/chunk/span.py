"""Where a ``Chunk`` decision applies: the head unit and the loss after it, read off a profile.

The region chunking runs in slices is an LM head and the cross-entropy after it,
up to the scalar loss: the head unit (an ``nn.Linear``-like map applied to each
token) is the last unit of the forward and every op after it is the loss's (the
upcast, label padding and shifting, log-softmax, NLL, a division by the count).
:func:`head_span` finds it and says why not when there is none; the planner
offers ``Chunk`` only there, so a step that reads the logits otherwise (an
accuracy, a hand-written z-loss) is never chunked.

A storage the region makes is *per token* when its leading dimensions hold the
head's rows (``B*T`` of them, or ``B*(T-1)`` once shifted): one slice holds
``ceil(rows / k) / rows`` of it. What the region's backward hands on (the head
input's gradient, the weight's) is whole.

Example:
    >>> span = head_span(prof)
    >>> span.why_not or (span.unit, span.rows)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gradckpt.profiling.records import NEVER, Profile, UnitRecord

__all__ = ["HeadSpan", "head_span", "itemsize", "rows_of"]


def _op(name: str) -> str:
    """``aten._log_softmax.default`` -> ``_log_softmax``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else name


# Ops of a head that maps each token alone (a linear layer, LoRA's extra path).
_HEAD_OPS = frozenset({
    "t", "view", "_unsafe_view", "reshape", "mm", "addmm", "bmm", "matmul", "linear", "add",
    "mul", "_to_copy", "clone", "expand", "transpose", "contiguous", "permute",
})  # fmt: skip
# Ops of a plain nn.Linear head (under autocast too): its backward is done in place by
# gradckpt.engine.chunking.linear_loss, with no second weight gradient per slice.
_LINEAR_OPS = frozenset({"t", "view", "_unsafe_view", "mm", "addmm", "_to_copy"})
# Ops of the loss after the head that may touch the logits: the upcast, a copy of
# shifted logits, the log-softmax; and the reduction.
_LOGIT_OPS = frozenset({"_to_copy", "clone", "_log_softmax", "view", "_unsafe_view", "slice"})
_LOSS_OPS = frozenset({"nll_loss_forward", "nll_loss2d_forward"})
# Label bookkeeping and the scalar arithmetic around the loss (never vocabulary-sized).
# The views among them are the ones lazy logits take lazily too
# (gradckpt.engine.chunking.lazy): a step whose loss reads the logits through another
# (expand, as_strided, detach) is not chunked.
_SMALL_OPS = frozenset({
    "constant_pad_nd", "slice", "clone", "view", "_unsafe_view", "_to_copy", "ne", "eq", "sum",
    "div", "mul", "add", "sub", "select", "unsqueeze", "squeeze", "lift_fresh",
    "scalar_tensor", "where", "masked_fill", "copy_", "fill_", "to",
    "_reshape_alias", "reshape", "contiguous", "neg", "mean", "item",
    "_local_scalar_dense", "zeros", "zeros_like", "ones_like", "full", "empty",
})  # fmt: skip


def itemsize(nbytes: int, shape: tuple[int, ...]) -> int:
    """Bytes per element of a storage of ``nbytes`` holding ``shape`` (4 if unknown)."""
    count = math.prod(shape) if shape else 0
    return max(1, nbytes // count) if count else 4


def rows_of(shape: tuple[int, ...]) -> int:
    """Rows (tokens) of a storage's shape: its leading dimensions, or its one dimension."""
    if len(shape) >= 2:
        return math.prod(shape[:-1])
    return shape[0] if shape else 1


@dataclass(frozen=True)
class HeadSpan:
    """The head unit and the loss after it, as a profile shows them."""

    unit: int = -1  # the head unit's index (-1: none)
    first_op: int = 0
    end_op: int = 0  # one past the loss's last forward op
    rows: int = 0  # tokens of the head's input
    #: Backward ops of the region: from backward's first op to the head's last.
    backward: range = range(0)
    #: Storages made in the region (forward or backward) that are per token.
    per_token: frozenset[int] = field(default_factory=frozenset)
    #: Storages the region's backward makes and hands on (gradients): whole.
    handed_on: frozenset[int] = field(default_factory=frozenset)
    #: The head is a plain ``nn.Linear``: its backward accumulates in place (see above).
    linear: bool = False
    #: Bytes per element of the logits the head computes (bf16 under autocast).
    logits_itemsize: int = 4
    #: Saved tensors of the loss's ops (outside every unit), inside the region.
    loss_packs: tuple[int, ...] = ()
    #: Saved tensors of the head unit and the loss together.
    saved: int = 0
    why_not: str = ""

    def slice_bytes(self, nbytes: int, chunks: int) -> int:
        """Bytes of one (the largest) slice of a per-token storage of ``nbytes``."""
        return -(-nbytes * -(-self.rows // chunks) // self.rows)



def _none(why: str) -> HeadSpan:
    return HeadSpan(why_not=why)


def head_span(profile: Profile) -> HeadSpan:
    """The chunkable head-and-loss region of ``profile``, or one whose ``why_not`` says why none.

    Example:
        >>> head_span(prof).why_not
        ''
    """
    forward = profile.ops[: profile.forward_ops]
    if not profile.units or not forward:
        return _none("the step has no units")
    head = max(profile.units, key=lambda u: u.first_op)
    shapes = dict(profile.input_shapes)
    if head.is_block or not head.plannable:
        return _none(f"the last unit, {head.path}, is a block, not a head")
    shape = shapes.get(head.path, ())
    rows = rows_of(shape) if len(shape) >= 2 else 0
    if rows < 2:
        return _none(f"the input of {head.path} has no token rows (shape {shape})")
    odd = [op.name for op in profile.unit_ops(head) if _op(op.name) not in _HEAD_OPS]
    if odd:
        return _none(f"{head.path} runs {odd[0]}, not a token-wise head")
    if head.output < 0 or rows_of(profile.storages[head.output].shape) != rows:
        return _none(f"{head.path} does not return one row per token")
    vocab = profile.storages[head.output].shape[-1]
    why = _loss_ops(profile, head, rows, vocab)
    if why:
        return _none(why)
    return _region(profile, head, rows)


def _is_per_token(shape: tuple[int, ...], rows: int) -> bool:
    return bool(shape) and rows // 2 < rows_of(shape) <= rows


def _loss_ops(profile: Profile, head: UnitRecord, rows: int, vocab: int) -> str:
    """Why the ops after the head are not a cross-entropy of its logits ("" when they are)."""
    after = profile.ops[head.end_op : profile.forward_ops]
    if any(op.unit >= 0 for op in after):
        return f"units run after {head.path}: it is not the last step before the loss"
    if not any(_op(op.name) in _LOSS_OPS for op in after):
        return f"no cross-entropy follows {head.path}"
    for op in after:
        name = _op(op.name)
        shapes = [profile.storages[s].shape for s in op.outputs]
        logits_like = any(_is_per_token(s, rows) and s[-1] == vocab for s in shapes)
        if name in _LOSS_OPS or (logits_like and name in _LOGIT_OPS):
            continue
        if name not in _SMALL_OPS or logits_like:
            return (
                f"the step reads the logits of {head.path} besides the cross-entropy "
                f"({op.name}): chunking would compute them whole"
            )
    return ""


def _region(profile: Profile, head: UnitRecord, rows: int) -> HeadSpan:
    ops = profile.ops
    last_bwd = max(
        (op.index for op in ops[profile.forward_ops :] if op.unit == head.index), default=-1
    )
    backward = range(profile.forward_ops, last_bwd + 1)
    if any(ops[i].unit not in (-1, head.index) for i in backward):
        return _none(f"the backward of {head.path} and its loss is interleaved with other units'")
    # Handed on: still live once the op after the region's backward ran (a gradient the
    # next unit's backward reads, or a parameter's); what the region's last op reads dies
    # before that op.
    after = backward[-1] + 1 if backward else len(ops)
    end_bwd = ops[after].position if after < len(ops) else NEVER
    made = [s for i in range(head.first_op, profile.forward_ops) for s in ops[i].outputs]
    made_bwd = [s for i in backward for s in ops[i].outputs]
    storages = profile.storages
    handed_on = frozenset(s for s in made_bwd if storages[s].free > end_bwd)
    per_token = frozenset(
        s for s in made + made_bwd
        if s not in handed_on and _is_per_token(storages[s].shape, rows)
    )  # fmt: skip
    linear = head.cls == "Linear" and all(
        _op(op.name) in _LINEAR_OPS for op in profile.unit_ops(head)
    )
    inside = range(head.first_op, profile.forward_ops)
    loss_packs = tuple(p.id for p in profile.packs if p.unit < 0 and p.ops_done - 1 in inside)
    return HeadSpan(
        unit=head.index, first_op=head.first_op, end_op=profile.forward_ops, rows=rows,
        backward=backward, per_token=per_token, handed_on=handed_on, linear=linear,
        logits_itemsize=itemsize(storages[head.output].nbytes, storages[head.output].shape),
        loss_packs=loss_packs,
        saved=len(loss_packs) + sum(1 for p in profile.packs if p.unit == head.index),
    )  # fmt: skip
