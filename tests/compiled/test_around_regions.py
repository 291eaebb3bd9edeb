"""torch.compile after gradckpt.apply: same gradients, and region bodies compiled inside regions.

Every test compares against the plain (unplanned, uncompiled) model from the
same seed with dropout on, within 1e-5 (aot_eager: no fusion, no reordering of
random draws).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradckpt
from gradckpt.apply.apply import applied_units
from gradckpt.compiled.around_regions import compile_model, compiled_units
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.planning.solving.solvers import save_matmuls_plan
from gradckpt.profiling import model_fingerprint
from gradckpt.testing import make

pytest.importorskip("torch._dynamo")
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

GPT = dict(layers=4, d_model=32, heads=2, seq=16, vocab=256, batch=2, dropout=0.1)
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def selective_block1():
    """blocks.1's save_matmuls choice (op positions and names from a real profile)."""
    ex = make("gpt", **GPT)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    return next(u for u in save_matmuls_plan(prof).units if u.path == "blocks.1")


def _mixed_plan(ex, selective) -> Plan:
    """A recompute unit, a selective unit and a segment (with a nested region)."""
    assert selective.mode == "selective" and selective.save
    items = (
        UnitChoice("tok_emb"), UnitChoice("pos_emb"), UnitChoice("drop"),
        UnitChoice("blocks.0", "recompute"),
        selective,
        Segment((UnitChoice("blocks.2"), UnitChoice("blocks.3", "recompute"))),
        UnitChoice("ln_f"), UnitChoice("lm_head"),
    )  # fmt: skip
    return Plan(items, model_fingerprint(ex.model))


def _counting_backend():
    """aot_eager, counting how often compiled forward graphs run."""
    runs: list[int] = []

    def forward_compiler(gm, _inputs):
        inner = make_boxed_func(gm)

        def run(args):
            runs.append(id(gm))
            return inner(args)

        run._boxed_call = True
        return run

    backend = aot_autograd(
        fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm)
    )
    return backend, runs


def _compile_torch(model):
    return torch.compile(model, backend="aot_eager")


def _compile_method(model):
    model.compile(backend="aot_eager")
    return model


def _compile_blocks(model):
    for block in model.blocks:
        block.compile(backend="aot_eager")
    return model


def _compile_model(model):
    return compile_model(model, backend="aot_eager")


def _compile_units(model):
    return compile_model(model, backend="aot_eager", whole_model=False)


@pytest.mark.parametrize(
    ("compile_it", "dynamo_loaded_at_apply"),
    [(_compile_torch, True), (_compile_method, True), (_compile_method, False),
     (_compile_blocks, True), (_compile_blocks, False), (_compile_model, True),
     (_compile_units, True)],
    ids=["torch.compile(model)", "model.compile()", "model.compile(), lazy wrappers",
         "block.compile()", "block.compile(), lazy wrappers", "compile_model",
         "compile_model(whole_model=False)"],
)  # fmt: skip
def test_compiled_after_apply_gives_the_plain_gradients(
    compile_it,
    dynamo_loaded_at_apply,
    selective_block1,
    monkeypatch,
    loss_and_grads,
    assert_steps_close,
):
    ex = make("gpt", **GPT)
    reference = loss_and_grads(ex)
    with monkeypatch.context() as patch:
        if not dynamo_loaded_at_apply:
            # As when torch._dynamo is first imported by the compile call: the installed
            # wrappers are plain functions, and Dynamo traces into them.
            patch.setattr(gradckpt.engine.dynamo, "loaded", lambda: False)
        gradckpt.apply(ex.model, _mixed_plan(ex, selective_block1))
    # The installed forward is an object (copyable, picklable); opaque means its call is disabled.
    forward = ex.model.blocks[0].forward
    assert hasattr(type(forward).__call__, "_torchdynamo_disable") == dynamo_loaded_at_apply
    compiled = compile_it(ex.model)

    def loss_fn():
        logits = compiled(ex.inputs["idx"])
        return torch.nn.functional.cross_entropy(
            logits.view(-1, logits.shape[-1]), ex.inputs["targets"].view(-1)
        )

    for _ in range(2):  # the second step runs the cached graphs
        ex.model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = loss_fn()
        loss.backward()
        got = loss.detach(), {k: p.grad.clone() for k, p in ex.model.named_parameters()}
        assert_steps_close(reference, got, ATOL)


def test_compile_model_reruns_compiled_bodies_in_the_recompute(selective_block1):
    ex = make("gpt", **GPT)
    gradckpt.apply(ex.model, _mixed_plan(ex, selective_block1))
    backend, runs = _counting_backend()
    compile_model(ex.model, backend=backend, whole_model=False)
    assert "blocks.1" not in compiled_units(ex.model)  # selective: stays eager
    assert {"blocks.0", "blocks.2", "blocks.3", "lm_head"} <= set(compiled_units(ex.model))
    for _ in range(2):
        runs.clear()
        torch.manual_seed(1)
        loss = ex.loss_fn()
        forward = len(runs)
        loss.backward()
        # Forward: tok_emb, pos_emb, drop, blocks.0, blocks.2, blocks.3, ln_f, lm_head
        # (blocks.1 is eager). Backward: blocks.0's recompute; the segment's recompute
        # runs blocks.2 and opens blocks.3's region; then blocks.3's own recompute.
        assert forward == 8
        assert len(runs) - forward == 4


def test_compiled_regions_update_batchnorm_statistics_once(
    loss_and_grads, assert_steps_close, blocks_plan
):
    ex = make("bn_convnet")
    saved = {k: b.clone() for k, b in ex.model.named_buffers()}
    reference = loss_and_grads(ex)
    after_plain = {k: b.clone() for k, b in ex.model.named_buffers()}
    with torch.no_grad():
        for k, b in ex.model.named_buffers():
            b.copy_(saved[k])
    plan = blocks_plan(ex)
    gradckpt.apply(ex.model, plan)
    compile_model(ex.model, backend="aot_eager", whole_model=False)
    assert_steps_close(reference, loss_and_grads(ex), ATOL)
    for k, b in ex.model.named_buffers():
        torch.testing.assert_close(b, after_plain[k], atol=ATOL, rtol=0, msg=k)


def test_regions_under_a_dispatch_mode_run_eagerly_in_forward_and_recompute(
    loss_and_grads, assert_steps_close, blocks_plan
):
    """MemoryTracker is a TorchDispatchMode: compiled code falls back to eager under it,
    and the recompute then stays eager too (same saved tensors)."""
    ex = make("gpt", **GPT)
    reference = loss_and_grads(ex)
    gradckpt.apply(ex.model, blocks_plan(ex))
    compile_model(ex.model, backend="aot_eager", whole_model=False)
    with gradckpt.measure.MemoryTracker(ex.model):
        got = loss_and_grads(ex)
    assert_steps_close(reference, got, ATOL)


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_mode_only_around_backward_is_refused_clearly(blocks_plan):
    ex = make("gpt", **GPT)
    gradckpt.apply(ex.model, blocks_plan(ex, blocks=["blocks.0"]))
    compile_model(ex.model, backend="aot_eager", whole_model=False)
    loss = ex.loss_fn()
    with _Passthrough(), pytest.raises(gradckpt.CheckpointError, match="recompute would run"):
        loss.backward()


def test_a_compiled_callable_inside_a_plain_region_runs_eagerly_both_times():
    backend, runs = _counting_backend()
    lin = torch.nn.Linear(8, 8)
    inner = torch.compile(lambda t: torch.nn.functional.dropout(lin(t).sin(), 0.3), backend=backend)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    inner(x).sum().backward()  # compiled outside a region: it runs compiled
    assert runs
    runs.clear()
    plain = [t.grad.clone() for t in (x, lin.weight)]
    x.grad = None
    lin.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    gradckpt.checkpoint(inner, x).sum().backward()
    assert runs == []  # force_eager inside the region, and in its recompute
    for a, b in zip(plain, (x.grad, lin.weight.grad)):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


def test_compile_model_without_a_plan_compiles_the_model(loss_and_grads, assert_steps_close):
    ex = make("mlp", blocks=2, width=16, hidden=32, batch=4)
    reference = loss_and_grads(ex)
    compile_model(ex.model, backend="aot_eager")
    assert compiled_units(ex.model) == []
    assert_steps_close(reference, loss_and_grads(ex), ATOL)


def test_compile_model_rejects_unknown_units():
    ex = make("mlp", blocks=2, width=16, hidden=32, batch=4)
    gradckpt.fit(ex.model, ex.loss_fn, 1.0, profiling=gradckpt.ProfileOptions(repeats=1))
    with pytest.raises(ValueError, match="not units"):
        compile_model(ex.model, units=["nowhere"], backend="aot_eager")


def test_compile_model_runs_compiled_bodies_of_kept_units_fit_left_unwrapped():
    """A keep-everything ``fit`` installs no forward on its kept units (they run plainly);
    compile_model wraps them so their compiled bodies run, and remove takes all back."""
    ex = make("gpt", **GPT)
    gradckpt.fit(ex.model, ex.loss_fn, budget=1.0, measure_candidates=0, chunking=False)
    units = list(applied_units(ex.model))
    assert [n for n, m in ex.model.named_modules() if "forward" in m.__dict__] == [""]
    backend, runs = _counting_backend()
    compile_model(ex.model, backend=backend, whole_model=False)
    assert set(compiled_units(ex.model)) == set(units)
    torch.manual_seed(1)
    ex.loss_fn()
    assert len(runs) == len(units)  # every unit ran its compiled body
    gradckpt.remove(ex.model)
    assert [n for n, m in ex.model.named_modules() if "forward" in m.__dict__] == []
