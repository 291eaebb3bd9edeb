"""Plan sets: shape keys, JSON round trip (old single-plan files still load), plan(shapes=),
and applying a loaded set switches plans by shape."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import gradckpt
from gradckpt.planning import Plan, UnitChoice
from gradckpt.planning.plans.planset import PlanSet, ShapeKey, load_plans, shape_key
from gradckpt.testing import mlp


def _plan(fingerprint="abc", peak=900) -> Plan:
    return Plan((UnitChoice("b.0", "recompute"), UnitChoice("head")), fingerprint,
                budget_bytes=1000, predicted_peak_bytes=peak)  # fmt: skip


def _key(*shape, name="input_ids") -> ShapeKey:
    return shape_key((), {name: torch.zeros(shape, dtype=torch.long)})


def test_shape_key_sees_shapes_dtypes_grad_and_names():
    x = torch.zeros(2, 8)
    assert shape_key((x,), {}) == shape_key((torch.ones(2, 8),), {})
    assert shape_key((x,), {}) != shape_key((torch.zeros(2, 9),), {})
    assert shape_key((x,), {}) != shape_key((x.double(),), {})
    leaf = torch.zeros(2, 8, requires_grad=True)
    assert shape_key((x,), {}) != shape_key((leaf,), {})
    assert _key(2, 8) != _key(2, 8, name="labels")
    assert shape_key((leaf, None), {"flag": True}).describe() == "(2,8):float32 grad, -, flag=True"
    # a flag's value can change memory (use_cache=True keeps a cache): it is in the key;
    # a keyword passed as None is one not passed, and keyword order changes nothing
    assert shape_key((x,), {"use_cache": False}) != shape_key((x,), {"use_cache": True})
    assert shape_key((x,), {"use_cache": None}) == shape_key((x,), {})
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert shape_key((), {"a": ids, "b": x}) == shape_key((), {"b": x, "a": ids})


def test_bounded_by_requires_same_structure_and_no_larger_dimension():
    assert _key(2, 100).bounded_by(_key(2, 128)) and _key(2, 128).bounded_by(_key(2, 128))
    assert not _key(2, 129).bounded_by(_key(2, 128))
    assert not _key(3, 100).bounded_by(_key(2, 128))
    assert not _key(2, 100, name="x").bounded_by(_key(2, 128))
    assert not _key(2, 100).bounded_by(shape_key((), {"input_ids": torch.zeros(2, 128)}))
    plans = PlanSet(((_key(2, 512), _plan(peak=3)), (_key(2, 128), _plan(peak=1))))
    assert plans.bounding(_key(2, 100))[0] == _key(2, 128)  # the smallest that bounds it
    assert plans.bounding(_key(2, 300))[0] == _key(2, 512)
    assert plans.bounding(_key(2, 600)) is None


def test_json_round_trip_and_single_plan_files_still_load(tmp_path):
    plans = PlanSet(((_key(2, 128), _plan(peak=1)), (_key(2, 512), _plan(peak=2))))
    path = tmp_path / "plans.json"
    plans.save(path)
    data = json.loads(path.read_text())
    assert data["kind"] == "gradckpt.PlanSet" and data["version"] == 1
    assert PlanSet.load(path) == plans and load_plans(path) == plans
    single = tmp_path / "plan.json"
    _plan().save(single)  # a file written before plan sets existed
    assert load_plans(single) == _plan()
    loaded = PlanSet.load(single)
    assert loaded.entries == ((None, _plan()),)
    with pytest.raises(ValueError, match="version 7"):
        PlanSet.from_json({**data, "version": 7})
    with pytest.raises(ValueError, match="not a gradckpt plan"):
        Plan.load(path)  # a set is not a single plan: the header says which it is


def test_a_set_is_for_one_model_and_one_plan_per_shape():
    with pytest.raises(ValueError, match="one model"):
        PlanSet(((_key(2, 1), _plan("a")), (_key(2, 2), _plan("b"))))
    with pytest.raises(ValueError, match="listed twice"):
        PlanSet(((_key(2, 1), _plan()), (_key(2, 1), _plan())))
    with pytest.raises(ValueError, match="at least one"):
        PlanSet(())


def _step(model, batch):
    g = torch.Generator().manual_seed(batch)
    x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return lambda: F.cross_entropy(model(x), y)


def _ce(out, x):
    return F.cross_entropy(out, torch.zeros(len(out), dtype=torch.long))


def test_plan_with_shapes_returns_a_set_and_apply_switches_by_shape(tmp_path):
    ex = mlp(blocks=3, width=64, hidden=256, batch=256)
    model = ex.model
    shapes = [(torch.zeros(384, 64),), (torch.zeros(512, 64),)]
    plans = gradckpt.plan(
        model, _step(model, 256), "4.5MiB", shapes=gradckpt.ShapeOptions(shapes, loss_from=_ce), profiling=gradckpt.ProfileOptions(repeats=1),    )
    assert isinstance(plans, PlanSet) and len(plans) == 3
    assert {p.budget_bytes for _, p in plans} == {int(4.5 * 2**20)}
    assert all(p.predicted_peak_bytes <= p.budget_bytes for _, p in plans)
    assert gradckpt.applied_plan(model) is None  # plan leaves the model untouched
    path = tmp_path / "plans.json"
    plans.save(path)
    gradckpt.apply(model, PlanSet.load(path))
    for batch in (384, 256, 512):
        model(torch.zeros(batch, 64)).sum().backward()
        key = shape_key((torch.zeros(batch, 64),), {})
        assert gradckpt.applied_plan(model) == plans.get(key)
    with pytest.raises(gradckpt.ShapeError, match=r"\(100,64\)"):
        model(torch.zeros(100, 64))
    assert gradckpt.shape_stats(model).switches == 3
    with pytest.raises(ValueError, match="apply cannot plan new shapes"):
        gradckpt.apply(model, plans, on_new_shape="replan")


def test_plan_with_infeasible_shape_names_it():
    ex = mlp(blocks=3, width=64, hidden=256, batch=256)
    with pytest.raises(gradckpt.BudgetError, match=r"at input shape \(16384,64\)"):
        gradckpt.plan(
            ex.model, _step(ex.model, 256), "4.5MiB", shapes=gradckpt.ShapeOptions([(torch.zeros(16384, 64),)], loss_from=_ce), profiling=gradckpt.ProfileOptions(repeats=1),
            )  # fmt: skip


def test_sequence_lengths_resize_the_fitted_inputs():
    from gradckpt.api.model_calls import Call, calls_for

    ids = torch.arange(6).reshape(1, 6)
    fitted = Call((), {"input_ids": ids, "labels": ids, "scale": 2.0}, _key(1, 6))
    [call] = calls_for(fitted, [10])
    assert call.kwargs["input_ids"].shape == (1, 10) and call.kwargs["scale"] == 2.0
    assert call.kwargs["input_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    with pytest.raises(TypeError, match="sequence length"):
        calls_for(fitted, [1.5])
