"""``written_args``: the arguments an op writes to, worked out once per op in the modes' cache."""

from __future__ import annotations

import torch

from gradckpt.engine.modes import _op_info, written_args

aten = torch.ops.aten


def test_writes_come_from_the_schema_plus_batch_norm_s_undeclared_ones():
    assert written_args(aten.add_.Tensor) == ((0,), ())
    assert written_args(aten.add.out) == ((), ("out",))
    assert written_args(aten.mm.default) == ((), ())
    # running_mean and running_var, updated in place without the schema saying so
    assert written_args(aten.native_batch_norm.default) == ((3, 4), ())


def test_the_fact_is_cached_once_with_the_op_s_other_facts():
    op = aten.mul_.Tensor
    assert written_args(op) is _op_info(op).writes
    assert written_args(op) is written_args(op)
