"""The shape key reads every tensor in a call's arguments (dicts, lists, dataclasses, nested
keywords) and every plain value; what it cannot read it names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gradckpt.planning.plans.planset import ShapeKey, shape_key


@dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor | None = None


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def _x(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


def test_a_batch_passed_as_one_dict_keys_its_tensors():
    # model(batch): before, a dict argument was one "-" whatever it held
    assert shape_key(({"x": _x(2, 8)},), {}) != shape_key(({"x": _x(2, 9)},), {})
    assert shape_key(({"x": _x(2, 8)},), {}).describe() == "[0].x=(2,8):float32"
    # the order of a dict's keys is no new shape
    a, b = _x(2, 8), torch.zeros(2, 8, dtype=torch.long)
    assert shape_key(({"a": a, "b": b},), {}) == shape_key(({"b": b, "a": a},), {})


def test_a_dataclass_batch_and_a_dict_inside_a_keyword_are_keyed():
    assert shape_key((Batch(_x(2, 8)),), {}) != shape_key((Batch(_x(4, 8)),), {})
    assert shape_key((Batch(_x(2, 8)),), {}) != shape_key((Batch(_x(2, 8), _x(2, 8)),), {})
    assert shape_key((), {"inputs": {"x": _x(2, 8)}}) != shape_key((), {"inputs": {"x": _x(3, 8)}})


def test_lists_tuples_and_nesting_are_keyed_leaf_by_leaf():
    small, big = _x(2, 8), _x(2, 16)
    assert shape_key(([small, small],), {}) != shape_key(([small, big],), {})
    assert shape_key((Pair(small, small),), {}) != shape_key((Pair(small, big),), {})
    deep = {"enc": [{"ids": small}], "n": 3}
    deeper = {"enc": [{"ids": big}], "n": 3}
    assert shape_key((deep,), {}) != shape_key((deeper,), {})
    assert "[0].enc[0].ids=(2,8):float32" in shape_key((deep,), {}).describe()


def test_plain_values_are_keyed_by_value():
    x = _x(2, 8)
    for a, b in ((3, 4), (True, False), (0.5, 0.25), ("mean", "none")):
        assert shape_key((x, a), {}) != shape_key((x, b), {})
        assert shape_key((x,), {"n": a}) != shape_key((x,), {"n": b})
    assert shape_key((x, None), {}) != shape_key((x, 0), {})
    assert shape_key((x,), {"n": 3}).describe() == "(2,8):float32, n=3"


def test_an_unreadable_argument_is_named_and_its_type_keyed():
    x = _x(2, 8)
    key = shape_key((x, object()), {"cfg": {"extra": object()}})
    assert key.unread() == ["[1] (object)", "cfg.extra (object)"]
    assert shape_key((x,), {}).unread() == []


def test_keys_with_values_and_containers_round_trip_through_json():
    key = shape_key(({"x": _x(2, 8), "n": 3},), {"flag": True, "mode": "train"})
    assert ShapeKey.from_json(json.loads(json.dumps(key.to_json()))) == key
