"""SavedBytesSolver: the compiler's partitioner held to a cap in saved bytes (issue 13, items 2-3).

Graphs are compiled with AOT autograd and the min-cut partitioner (what
inductor uses) and read, not run by inductor: what the forward graph hands to
backward is exactly what the partition saved. Tested: the solver's byte
accounting is the graph's, the cap holds, recompute never grows with the cap,
and gradients are the plain model's (aot_eager-style, within 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from gradckpt.compiled.knapsack import SavedBytesSolver, saved_bytes_cap
from gradckpt.testing import make

pytest.importorskip("torch._dynamo")
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

GPT = dict(layers=2, d_model=32, heads=2, seq=32, vocab=64, batch=2, dropout=0.1)
FRACTIONS = (0.2, 0.4, 0.6, 0.8, 1.0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_outputs_backend(backward_flops=None):
    """Forward graphs' output bytes (user outputs + what is saved for backward), recorded.

    ``backward_flops`` (a list) also gets each backward graph's FLOPs: the
    gradients' own plus what is recomputed.
    """
    from gradckpt.compiled.knapsack import _flops

    outputs: list[int] = []

    def forward(gm, _inputs):
        node = next(n for n in gm.graph.nodes if n.op == "output")
        vals = [getattr(a, "meta", {}).get("val") for a in node.args[0]]
        outputs.append(sum(v.numel() * v.element_size() for v in vals if torch.is_tensor(v)))
        return make_boxed_func(gm)

    def backward(gm, _inputs):
        if backward_flops is not None:
            nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
            backward_flops.append(sum(_flops(n) for n in nodes if _flops(n) > 1))
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=forward, bw_compiler=backward,
        partition_fn=min_cut_rematerialization_partition,
    )  # fmt: skip
    return backend, outputs


def _compiled_under_cap(fraction, sizes=GPT, backward_flops=None, knob=None):
    torch._dynamo.reset()
    ex = make("gpt", **sizes)
    backend, outputs = _graph_outputs_backend(backward_flops)
    ex.model.compile(backend=backend, fullgraph=True)
    with saved_bytes_cap(fraction, knob=knob) as solver:
        ex.loss_fn().backward()
    assert len(solver.chosen) == 1 and len(outputs) == 1  # one graph
    return solver.chosen[0], outputs[0]


def test_cap_holds_in_the_graph_and_recompute_never_grows_with_it():
    results = {f: _compiled_under_cap(f) for f in FRACTIONS}
    # The solver's bytes are the graph's: forward outputs = user outputs (fixed) + saved.
    user_outputs = {graph - choice.saved_bytes for choice, graph in results.values()}
    assert len(user_outputs) == 1, results
    default = {choice.default_bytes for choice, _ in results.values()}
    assert len(default) == 1
    least = min(choice.saved_bytes for choice, _ in results.values())
    for fraction, (choice, _) in results.items():
        assert choice.cap_bytes == pytest.approx(fraction * choice.default_bytes)
        # Held, or nothing the partitioner can reach fits and it saves its least.
        assert choice.saved_bytes <= choice.cap_bytes or choice.saved_bytes == least
    assert results[0.6][0].saved_bytes < results[0.6][0].default_bytes  # a real trade
    flops = [results[f][0].recompute_flops for f in FRACTIONS]
    assert flops == sorted(flops, reverse=True), flops
    assert flops[0] > flops[-1]  # a lower cap did buy its bytes with recompute


def _assert_plain_gradients_under(partitioner_config):
    def grads(ex):
        ex.model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = ex.loss_fn()
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in ex.model.named_parameters()}

    ref_loss, ref = grads(make("gpt", **GPT))
    ex = make("gpt", **GPT)
    ex.model.compile(backend="aot_eager")
    with partitioner_config:
        loss, got = grads(ex)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=0, msg=k)


def test_compiled_under_a_cap_gives_plain_gradients():
    # Fails if random ops are offered for recompute: dropout then draws new masks.
    _assert_plain_gradients_under(saved_bytes_cap(0.3))


@pytest.mark.xfail(
    strict=True,
    reason="torch 2.13: at activation_memory_budget=0.1 the partitioner's knapsack may "
    "recompute native_dropout, and aot_eager does not replay its RNG (README: Compiled). "
    "If this passes, torch fixed it: drop the mark and the README's claim.",
)
def test_the_compilers_own_knob_gives_plain_gradients_with_dropout():
    import torch._functorch.config as functorch_config

    _assert_plain_gradients_under(functorch_config.patch(activation_memory_budget=0.1))


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_a_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
        SavedBytesSolver(fraction)
    with pytest.raises(ValueError, match=r"knob .* outside \[0, 1\]"):
        SavedBytesSolver(knob=fraction)


def test_exactly_one_of_fraction_and_knob():
    for kwargs in ({}, {"fraction": 0.5, "knob": 0.5}):
        with pytest.raises(ValueError, match=r"exactly one of fraction= .* and knob="):
            SavedBytesSolver(**kwargs)


def test_solver_identity_separates_compile_caches():
    assert SavedBytesSolver(0.5).uuid() == SavedBytesSolver(0.5).uuid()
    assert SavedBytesSolver(0.5).uuid() != SavedBytesSolver(0.4).uuid()
    assert SavedBytesSolver(knob=0.5).uuid() != SavedBytesSolver(0.5).uuid()


@pytest.mark.parametrize("knob", [0.5, 0.3])
def test_at_the_compilers_saved_bytes_it_recomputes_no_more(knob):
    """Capped at what the compiler's own knob saves: no more saved, no more recompute FLOPs.

    Without dropout: the compiler may recompute random ops, which the solver
    never offers (they would change the masks), so with dropout it can need
    more recompute for the same bytes.
    """

    sizes = {**GPT, "dropout": 0.0}
    compiler_saved, compiler_flops = _compiler_at_knob(knob, sizes)
    default, _ = _compiled_under_cap(1.0, sizes)
    assert compiler_saved < default.default_bytes  # the knob did trade bytes for recompute
    our_flops: list[float] = []
    ours, _ = _compiled_under_cap(compiler_saved / default.default_bytes, sizes, our_flops)
    assert ours.saved_bytes <= compiler_saved
    assert our_flops[0] <= compiler_flops, (our_flops, compiler_flops)


def _compiler_at_knob(knob, sizes):
    """What the compiler's own knob saves (read from its forward graph) and its backward FLOPs."""
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    ex = make("gpt", **sizes)
    flops: list[float] = []
    backend, outputs = _graph_outputs_backend(flops)
    ex.model.compile(backend=backend, fullgraph=True)
    with functorch_config.patch(activation_memory_budget=knob):
        ex.loss_fn().backward()
    default, default_graph = _compiled_under_cap(1.0, sizes)
    return outputs[0] - (default_graph - default.saved_bytes), flops[0]


# On this GPT the routes are: 1.0 default, 0.8 more aggressive (its share is 0.77), 0.5
# aggressive (0.50), 0.3 knapsack, 0.0 inputs only.
@pytest.mark.parametrize("knob", [1.0, 0.8, 0.5, 0.3, 0.0])
def test_a_knob_cap_is_what_the_compilers_knob_saves_and_is_dominated(knob):
    """``knob=`` caps at exactly the bytes the compiler's own knob saves for the graph (every
    route of the partitioner: default, more aggressive, aggressive, knapsack, inputs only), and
    the answer saves no more and recomputes no more FLOPs than the compiler's. Without dropout,
    as above."""
    sizes = {**GPT, "dropout": 0.0}
    compiler_saved, compiler_flops = _compiler_at_knob(knob, sizes)
    our_flops: list[float] = []
    ours, _ = _compiled_under_cap(None, sizes, our_flops, knob=knob)
    assert ours.cap_bytes == compiler_saved
    assert ours.saved_bytes <= compiler_saved
    assert our_flops[0] <= compiler_flops, (our_flops, compiler_flops)
