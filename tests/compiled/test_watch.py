"""Dynamo recompiles of a compiled, planned model under shape changes are reported (issue 13).

The counts are Dynamo's own compile ids (a frame's attempt above 0 is a
recompile), checked against what Dynamo is documented to do: with
``dynamic=False`` every new length recompiles; by default the second length
recompiles once with the length marked dynamic, and a third does not.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import gradckpt
from gradckpt.compiled.watch import compile_stats
from gradckpt.testing import make

pytest.importorskip("torch._dynamo")

GPT = dict(layers=2, d_model=32, heads=2, seq=32, vocab=64, batch=2, dropout=0.1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Local profile-guided dynamism remembers, across resets and processes, that a
    # frame saw several lengths and compiles it dynamic at once: off, so each test
    # sees Dynamo's documented behaviour from a fresh start.
    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        yield
    torch._dynamo.reset()


def _loss_at(ex, length: int):
    idx, targets = ex.inputs["idx"][:, :length], ex.inputs["targets"][:, :length]

    def loss_fn():
        logits = ex.model(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return loss_fn


def _steps(ex, lengths) -> list[list[str]]:
    """One training step per length; the gradckpt recompile warnings each raised."""
    raised = []
    for length in lengths:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _loss_at(ex, length)().backward()
        raised.append([str(w.message) for w in caught if "recompile" in str(w.message)])
    return raised


def test_each_new_length_recompiles_when_not_dynamic_and_warns_once_per_shape(blocks_plan):
    ex = make("gpt", **GPT)
    gradckpt.apply(ex.model, blocks_plan(ex))
    gradckpt.compile(ex.model, backend="aot_eager", dynamic=False)
    raised = _steps(ex, [32, 32, 16, 16, 24])
    stats = compile_stats(ex.model)
    assert stats.calls == 5
    assert [bool(r) for r in raised] == [False, False, True, False, True]
    assert "(2,16)" in raised[2][0] and "dynamic=True" in raised[2][0]
    assert stats.recompiles >= 2  # the root frame at least, at 16 and at 24
    assert stats.compiles > stats.recompiles  # the first call's compiles are not recompiles
    assert len(stats.shapes) == 2  # the calls that recompiled: at 16, then at 24
    assert "(2,16)" in stats.shapes[0] and "(2,24)" in stats.shapes[1]


def test_dynamic_shapes_recompile_once_then_not_again(blocks_plan):
    ex = make("gpt", **GPT)
    gradckpt.apply(ex.model, blocks_plan(ex))
    gradckpt.compile(ex.model, backend="aot_eager")  # automatic dynamic (the default)
    raised = _steps(ex, [32, 16, 24, 20])
    assert [bool(r) for r in raised] == [False, True, False, False]
    assert compile_stats(ex.model).recompiles >= 1
    assert all("(2,16)" in s for s in compile_stats(ex.model).shapes)


def test_fit_compile_reports_recompiles_in_shape_stats():
    ex = make("gpt", **GPT)
    gradckpt.fit(
        ex.model, _loss_at(ex, 32), budget=0.85, compile={"backend": "aot_eager", "dynamic": False},
        measure_candidates=0, profiling=gradckpt.ProfileOptions(repeats=1),
    )  # fmt: skip
    _steps(ex, [32, 32])
    assert gradckpt.shape_stats(ex.model).recompiles == 0
    _steps(ex, [16])  # a new shape: re-planned by the guard, and recompiled by Dynamo
    stats = gradckpt.shape_stats(ex.model)
    assert stats.replans == 1
    assert stats.recompiles == compile_stats(ex.model).recompiles >= 1
    assert f"{stats.recompiles} torch._dynamo recompile(s)" in stats.summary()
