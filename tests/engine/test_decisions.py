"""Typed decisions: Keep / Recompute / Selective / Offload as values, and what a policy may answer.

Recompute is measured as in test_policies: ATen ops and FLOPs that run during
backward, against the plain run's backward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import gradckpt
from gradckpt.engine.decisions import (
    Offloadable,
    Saveable,
    as_decision,
    decision_from_json,
    decision_kinds,
)

from .test_policies import Block, _grads_equal, _recomputed, _step

aten = torch.ops.aten


def test_decisions_are_frozen_values_and_the_old_names_are_instances():
    assert gradckpt.Keep() == gradckpt.SAVE and gradckpt.Recompute() == gradckpt.RECOMPUTE
    assert gradckpt.Keep() != gradckpt.Recompute()
    assert isinstance(gradckpt.SAVE, gradckpt.Decision)
    assert Saveable is gradckpt.Keep and Offloadable is gradckpt.Offload  # JAX's names
    selective = gradckpt.Selective((1, 4), ("aten.mm.default", "aten.addmm.default"))
    assert hash(selective) == hash(gradckpt.Selective((1, 4), selective.save_ops))
    with pytest.raises(dataclasses.FrozenInstanceError):
        selective.save = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="same length"):
        gradckpt.Selective((1,), ())


def test_every_kind_has_a_plan_file_name_that_reads_back():
    assert list(decision_kinds())[:4] == ["keep", "recompute", "selective", "offload"]
    for decision in (
        gradckpt.Keep(),
        gradckpt.Recompute(),
        gradckpt.Selective((2,), ("aten.mm.default",)),
        gradckpt.Offload(),
    ):
        assert decision_from_json(decision.kind, decision.to_json()) == decision
    with pytest.raises(ValueError, match="sometimes"):
        decision_from_json("sometimes", {})


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (True, gradckpt.SAVE),
        (False, gradckpt.RECOMPUTE),
        (gradckpt.Keep(), gradckpt.SAVE),
        (gradckpt.Recompute(), gradckpt.RECOMPUTE),
        (CheckpointPolicy.MUST_SAVE, gradckpt.SAVE),
        (CheckpointPolicy.PREFER_SAVE, gradckpt.SAVE),
        (CheckpointPolicy.MUST_RECOMPUTE, gradckpt.RECOMPUTE),
        (CheckpointPolicy.PREFER_RECOMPUTE, gradckpt.RECOMPUTE),
    ],
)
def test_policy_answers_map_onto_the_two_engine_decisions(answer, expected):
    # The engine compares with `is`: fresh Keep()/Recompute() come back as SAVE/RECOMPUTE.
    assert as_decision(answer, aten.mm.default, None) is expected


def test_fresh_keep_instances_keep_like_save(plain):
    def keep_everything(ctx, op, *args, **kwargs):
        return gradckpt.Keep()  # a new instance each call, not the SAVE object

    ours = _step(Block(), keep_everything)
    _grads_equal(ours, plain)
    for op in ("aten.addmm.default", "aten.mm.default", "aten.gelu.default"):
        assert _recomputed(ours, plain, op) == 0, op
    assert ours[2] == plain[2]


@pytest.fixture
def plain():
    return _step(Block(), None, ckpt=False)


@pytest.mark.parametrize("answer", [CheckpointPolicy.MUST_CPU_OFFLOAD, gradckpt.Offload()])
def test_offload_is_a_unit_decision_not_a_per_op_answer(answer):
    def policy(ctx, op, *args, **kwargs):
        return answer

    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(TypeError, match=r"aten\.sin\.default.*whole units"):
        gradckpt.checkpoint(torch.sin, x, policy=policy)


def test_a_unit_decision_is_not_a_per_op_answer():
    def policy(ctx, op, *args, **kwargs):
        return gradckpt.Selective()

    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(TypeError, match="whole units"):
        gradckpt.checkpoint(torch.sin, x, policy=policy)
