"""The simulator against measurement, for every plan shape the engine can run."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.measure import count_flops
from gradckpt.planning import Plan, Segment, UnitChoice, simulate
from gradckpt.planning.solving.solvers import save_matmuls_plan

from .conftest import ZOO_NAMES, assert_same_step, run_step


def _shapes(prof):
    units = [u for u in prof.units if u.plannable]
    blocks = [u for u in units if u.is_block]

    def uniform(mode_of):
        return Plan(tuple(UnitChoice(u.path, mode_of(u)) for u in units), prof.fingerprint)

    yield "every-block", uniform(lambda u: "recompute" if u.is_block else "keep")
    yield "every-unit", uniform(lambda u: "recompute")
    yield "save-matmuls", save_matmuls_plan(prof)
    items, i = [], 0
    while i < len(units):
        u = units[i]
        nxt = units[i + 1] if i + 1 < len(units) else None
        if u.is_block and nxt is not None and nxt.is_block and nxt.chained:
            items.append(Segment((UnitChoice(u.path, "recompute"), UnitChoice(nxt.path))))
            i += 2
        else:
            items.append(UnitChoice(u.path))
            i += 1
    yield "pairs", Plan(tuple(items), prof.fingerprint)
    run = blocks[:1]
    for b in blocks[1:]:
        if b.chained and b.index == run[-1].index + 1:
            run.append(b)
        elif len(run) < 4:
            run = [b]
    if len(run) >= 4:
        inner = tuple(
            Segment((UnitChoice(run[j].path, "recompute"), UnitChoice(run[j + 1].path)))
            for j in range(0, len(run) - 1, 2)
        ) + ((UnitChoice(run[-1].path),) if len(run) % 2 else ())
        first, last = run[0].first_op, run[-1].end_op
        before = tuple(UnitChoice(u.path) for u in units if u.end_op <= first)
        after = tuple(UnitChoice(u.path) for u in units if u.first_op >= last)
        yield "nested", Plan((*before, Segment(inner), *after), prof.fingerprint)


def _step_flops(ex) -> int:
    """FLOPs of one training step; buffers (BatchNorm statistics) are put back after."""
    saved = {k: b.clone() for k, b in ex.model.named_buffers()}
    torch.manual_seed(0)
    flops = count_flops(lambda: ex.loss_fn().backward()).total
    ex.model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for k, b in ex.model.named_buffers():
            b.copy_(saved[k])
    return flops


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_predicted_peak_and_recompute_flops_match_measurement(zoo, name):
    ex, prof, plain = zoo.get(name)
    plain_flops = _step_flops(ex)
    for label, plan in _shapes(prof):
        pred = simulate(prof, plan)
        gradckpt.apply(ex.model, plan)
        try:
            step = run_step(ex)
            flops = _step_flops(ex)
        finally:
            gradckpt.remove(ex.model)
        # The allocator's peak (workspaces included), within 2%.
        assert abs(pred.peak_bytes - step.peak) <= 0.02 * step.peak, (
            label,
            pred.peak_bytes,
            step.peak,
        )
        assert pred.recompute_flops == flops - plain_flops, label
        assert_same_step(step, plain)


def test_plain_plan_is_the_profiled_step(zoo):
    _, prof, plain = zoo.get("gpt")
    keep = Plan(tuple(UnitChoice(u.path) for u in prof.units if u.plannable), prof.fingerprint)
    pred = simulate(prof, keep)
    assert pred.peak_bytes == prof.measured_peak_bytes == plain.peak
    assert pred.recompute_flops == 0 and pred.overhead == 0.0


def test_simulate_refuses_plans_for_units_it_does_not_know(zoo):
    _, prof, _ = zoo.get("mlp")
    with pytest.raises(ValueError, match="does not have"):
        simulate(prof, Plan((UnitChoice("ghost", "recompute"),), prof.fingerprint))


def test_segments_must_span_consecutive_chained_units(zoo):
    _, prof, _ = zoo.get("unet")
    units = [u for u in prof.units if u.plannable]
    # down.2 -> up.0 skips the bottleneck between them.
    paths = [u.path for u in units]
    i = paths.index("down.2")
    items = (
        *tuple(UnitChoice(p) for p in paths[:i]),
        Segment((UnitChoice("down.2"), UnitChoice("up.0"))),
        *tuple(UnitChoice(p) for p in paths if p not in [*paths[: i + 1], "up.0"]),
    )
    with pytest.raises(ValueError, match="consecutive units"):
        simulate(prof, Plan(items, prof.fingerprint))


def test_cuda_profile_counts_each_storage_as_a_512_byte_rounded_block():
    from dataclasses import replace

    from gradckpt.measure.allocator import allocator_block_bytes
    from gradckpt.planning.solving.solvers import none_plan

    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x = torch.randn(7, 3)  # 7x5 floats = 140 B: far from a multiple of 512
    prof = gradckpt.profile(model, lambda: model(x).sum(), repeats=1)
    plain = none_plan(prof)
    on_cuda = simulate(replace(prof, device="cuda"), plain).peak_bytes
    rounded = replace(
        prof,
        storages=tuple(replace(s, nbytes=allocator_block_bytes(s.nbytes)) for s in prof.storages),
    )
    assert on_cuda == simulate(rounded, plain).peak_bytes > simulate(prof, plain).peak_bytes
    assert allocator_block_bytes(0) == 0 and allocator_block_bytes(1) == 512
    assert allocator_block_bytes(512) == 512 and allocator_block_bytes(513) == 1024
