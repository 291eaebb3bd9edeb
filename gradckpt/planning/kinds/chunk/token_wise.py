"""Token-wise layers inside blocks (an MLP), found on a profile: what MLP chunking may slice.

Mini-Sequence Transformer's other half: a block's feed-forward holds a hidden
activation 4-8x the block's width for every token, live at once in the forward
and in each block's recompute. When the module's output for a token depends on
that token alone, it can run in ``k`` slices of tokens, each under checkpoint,
so that only one slice of its hidden lives at a time.

Whether a module is token-wise is read off its ops in the profile, never its
class name (:func:`token_wise_spans`): a recorded call of an inner module
(:mod:`gradckpt.profiling.sub_calls`) qualifies when

* it takes one tensor and returns one row per token of it (``rows``: the
  product of the input's leading dimensions);
* each of its ops is a row-wise kind (matmuls with a weight, elementwise
  activations and arithmetic, casts, copies, views, reductions over the last
  dimension) and every storage it makes keeps the token rows as its leading
  dimensions: a softmax over tokens, attention's ``(B, heads, T, T)`` scores, a
  sum or a mean over the tokens, a flattened ``(B, T*H)`` view fed to a matmul
  all make storages with other rows, and are refused;
* it draws no random numbers (dropout): slices would draw other masks than
  the whole, and gradients would no longer equal the plain step's.

Example:
    >>> spans, why_not = token_wise_spans(prof)
    >>> [s.path for s in spans.values()], why_not.get("model.layers.0.self_attn")
"""

from __future__ import annotations

from dataclasses import dataclass

from gradckpt.planning.kinds.chunk.span import rows_of
from gradckpt.planning.simulation.per_profile import per_profile
from gradckpt.profiling.records import NEVER, Profile
from gradckpt.profiling.sub_calls import SubCallRecord

__all__ = ["TokenSpan", "token_wise_spans"]

# Ops that treat each row (token) alone when every storage they make keeps the rows.
_ROW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "t", "mm", "addmm", "matmul", "linear", "bmm",
    "silu", "gelu", "relu", "sigmoid", "tanh", "mul", "add", "sub", "div", "neg", "pow",
    "rsqrt", "sqrt", "exp", "erf", "_to_copy", "clone", "contiguous", "mean", "sum",
    "native_layer_norm", "detach", "alias", "expand", "unsqueeze", "squeeze", "split",
    "split_with_sizes", "chunk", "slice", "narrow", "lift_fresh", "hardtanh", "leaky_relu",
    "elu", "softplus", "square", "where", "masked_fill", "abs", "clamp", "copy_",
})  # fmt: skip
_RANDOM = ("dropout", "bernoulli", "rand", "normal", "uniform", "multinomial")


def _op(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else name


@dataclass(frozen=True)
class TokenSpan:
    """A token-wise call inside a block, in profile terms."""

    path: str  # the module's path (what a plan names)
    unit: int  # index of the unit (block) whose forward calls it
    first_op: int
    end_op: int
    rows: int  # tokens of its input
    input: int  # storage id of its input (-1: made outside the step)
    output: int
    #: Storages it makes in the forward, one per token, besides its output.
    forward: frozenset[int]
    #: Storages its backward makes per token and frees within it.
    backward: frozenset[int]
    #: Its saved tensors (pack ids) and the positions its backward spans.
    packs: tuple[int, ...]
    backward_start: int
    backward_stop: int
    #: Parameters' gradients its backward makes (they outlive it, whole).
    weight_grads: tuple[int, ...] = ()
    #: Ops its backward runs (those of its block's backward between its saved tensors'
    #: first unpack and last release).
    backward_ops: int = 0

    def slice_bytes(self, nbytes: int, chunks: int) -> int:
        """Bytes of one (the largest) slice of a per-token storage of ``nbytes``."""
        return -(-nbytes * -(-self.rows // chunks) // self.rows)


def _why_not(profile: Profile, call: SubCallRecord, paths: dict[str, int]) -> str:
    if paths[call.path] > 1:
        return "called more than once per step"
    if call.tensor_args != 1 or len(call.input_shape) < 2:
        return "takes other tensors than one (tokens, width) input"
    rows = rows_of(call.input_shape)
    if rows < 2 or call.output < 0 or rows_of(call.output_shape) != rows:
        return f"does not return one row per token of its input {call.input_shape}"
    ops = profile.ops[call.first_op : call.end_op]
    for op in ops:
        if any(word in _op(op.name) for word in _RANDOM):
            return f"runs {op.name}: slices would draw other random numbers than the whole"
    for op in ops:
        name = _op(op.name)
        if name not in _ROW_OPS:
            return f"runs {op.name}, not a row-wise op"
        for sid in op.outputs:
            shape = profile.storages[sid].shape
            if not shape or rows_of(shape) != rows:
                return f"{op.name} makes a {shape} tensor: it mixes or reduces the {rows} tokens"
    return ""


def _span(profile: Profile, call: SubCallRecord) -> TokenSpan | None:
    rows = rows_of(call.input_shape)
    storages = profile.storages
    made = [s for op in profile.ops[call.first_op : call.end_op] for s in op.outputs]
    forward = frozenset(s for s in made if s != call.output)
    if not forward:
        return None  # nothing to slice (no hidden activation)
    packs = tuple(
        p.id for p in profile.packs
        if p.unit == call.unit and call.first_op < p.ops_done <= call.end_op
    )  # fmt: skip
    used = [p for p in packs if profile.packs[p].unpack < NEVER]
    if not used:
        return None
    start = min(profile.packs[p].unpack for p in used) - 8
    stop = max(profile.packs[p].release for p in used) + 12
    back_ops = [
        op for op in profile.ops[profile.forward_ops :]
        if op.unit == call.unit and start <= op.position <= stop
    ]  # fmt: skip
    made_back = [s for op in back_ops for s in op.outputs]
    backward = frozenset(
        s for s in made_back
        if storages[s].shape and rows_of(storages[s].shape) == rows and storages[s].free <= stop
    )  # fmt: skip
    grads = set(profile.grad_storages)
    return TokenSpan(
        call.path, call.unit, call.first_op, call.end_op, rows, call.input, call.output,
        forward, backward, packs, start, stop, tuple(s for s in made_back if s in grads),
        len(back_ops),
    )  # fmt: skip


@per_profile
def _spans(profile: Profile) -> tuple[dict[str, TokenSpan], dict[str, str]]:
    paths: dict[str, int] = {}
    for call in profile.sub_calls:
        paths[call.path] = paths.get(call.path, 0) + 1
    spans: dict[str, TokenSpan] = {}
    why: dict[str, str] = {}
    for call in profile.sub_calls:
        reason = _why_not(profile, call, paths)
        span = None if reason else _span(profile, call)
        if span is None:
            why[call.path] = reason or "holds nothing per token to slice"
        else:
            spans[call.path] = span
    return spans, why


def token_wise_spans(profile: Profile) -> tuple[dict[str, TokenSpan], dict[str, str]]:
    """The token-wise inner calls of ``profile`` by module path, and why each other is not.

    Example:
        >>> spans, why_not = token_wise_spans(prof)
        >>> why_not["model.layers.0.self_attn"]
        'runs aten._scaled_dot_product_flash_attention_for_cpu.default, not a row-wise op'
    """
    return _spans(profile)
