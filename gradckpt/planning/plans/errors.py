"""Reading plan files: a malformed one is one :class:`PlanFormatError` naming the file and field.

A plan file is data written by :meth:`gradckpt.Plan.save`; an edited, truncated
or foreign file would otherwise surface as a ``KeyError``, ``TypeError`` or
``JSONDecodeError`` from deep inside the loader. :func:`check_plan_fields` walks
the JSON once and names the first field that is missing or of the wrong type.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["PlanFormatError", "check_plan_fields"]

_NUMBERS = {
    "budget_bytes": "an int or null",
    "predicted_peak_bytes": "an int",
    "baseline_peak_bytes": "an int",
    "predicted_step_time": "a number",
    "baseline_step_time": "a number",
    "predicted_recompute_flops": "an int",
}
_OPTIONAL_NUMBERS = ("measured_overhead", "host_op_seconds")  # null: not measured, not assumed
_OPTIONAL_INTS = ("measured_compiled_peak_bytes",)  # null unless fit(compile=True) measured
_KNOWN = {"kind", "version", "items", "fingerprint", "solver", "input_shapes", "not_planned",
          "measured_overhead_range", "peak_level", "offload", "step", "token_chunks",
          *_OPTIONAL_NUMBERS,
          *_OPTIONAL_INTS, *_NUMBERS}  # fmt: skip


class PlanFormatError(ValueError):
    """A plan file (or plan JSON) is malformed; the message names the file and the field."""


def _fail(source: str | None, field: str, problem: str) -> PlanFormatError:
    where = f"{source}: " if source else ""
    return PlanFormatError(
        f"{where}malformed gradckpt plan: {field} {problem}. Write plans with plan.save(path) "
        "and do not edit them, or plan the model again"
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_items(items: Any, field: str, source: str | None) -> None:
    if not isinstance(items, list) or not items:
        raise _fail(source, field, "must be a non-empty list of units and segments")
    for i, item in enumerate(items):
        at = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise _fail(source, at, f"must be an object, got {type(item).__name__}")
        if "segment" in item:
            _check_items(item["segment"], f"{at}.segment", source)
            continue
        if not isinstance(item.get("path"), str):
            raise _fail(source, f"{at}.path", "is missing or not a string")
        if not isinstance(item.get("mode"), str):
            raise _fail(source, f"{at}.mode", "is missing or not a string")
        for key in ("save", "save_ops"):
            value = item.get(key, [])
            kind = _is_int if key == "save" else (lambda x: isinstance(x, str))
            if not isinstance(value, list) or not all(kind(x) for x in value):
                raise _fail(source, f"{at}.{key}", "must be a list of "
                            + ("op positions (ints)" if key == "save" else "op names"))  # fmt: skip


def check_plan_fields(data: Any, source: str | None = None) -> None:
    """Raise :class:`PlanFormatError` for the first missing or mistyped field of plan JSON.

    Example:
        >>> check_plan_fields(json.loads(Path("plan.json").read_text()), "plan.json")
    """
    if not isinstance(data, dict):
        raise _fail(source, "the document", f"must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _KNOWN)
    if unknown:
        raise _fail(source, f"field {unknown[0]!r}", "is not a plan field")
    _check_items(data.get("items"), "items", source)
    if not isinstance(data.get("fingerprint"), str):
        raise _fail(source, "fingerprint", "is missing or not a string")
    for key, kind in _NUMBERS.items():
        value = data.get(key, 0)
        if value is None and key == "budget_bytes":
            continue
        ok = _is_int(value) if "int" in kind else isinstance(value, numbers.Real)
        if not ok or isinstance(value, bool):
            raise _fail(source, key, f"must be {kind}, got {value!r}")
    for key in _OPTIONAL_NUMBERS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise _fail(source, key, f"must be a number or null, got {value!r}")
    for key in _OPTIONAL_INTS:
        value = data.get(key)
        if value is not None and not _is_int(value):
            raise _fail(source, key, f"must be an int or null, got {value!r}")
    spread = data.get("measured_overhead_range")
    if spread is not None and not (
        isinstance(spread, (list, tuple)) and len(spread) == 2
        and all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in spread)
    ):  # fmt: skip
        raise _fail(
            source, "measured_overhead_range", f"must be [low, high] or null, got {spread!r}"
        )
    if not isinstance(data.get("solver", ""), str):
        raise _fail(source, "solver", "must be a string")
    if data.get("peak_level", "tensors") not in ("allocator", "tensors"):
        level = data["peak_level"]
        raise _fail(source, "peak_level", f"must be 'allocator' or 'tensors', got {level!r}")
    for key, second in (("input_shapes", "a shape (list of ints)"), ("not_planned", "an int")):
        pairs = data.get(key, [])
        if not isinstance(pairs, list):
            raise _fail(source, key, "must be a list of [path, value] pairs")
        for i, pair in enumerate(pairs):
            good = (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                    and (_is_int(pair[1]) if key == "not_planned" else
                         isinstance(pair[1], list) and all(_is_int(x) for x in pair[1])))  # fmt: skip
            if not good:
                raise _fail(source, f"{key}[{i}]", f"must be [path, {second}]")
