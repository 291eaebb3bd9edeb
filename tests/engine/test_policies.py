"""Checklist item 35 and the stock policies: what is saved is really not recomputed.

Recompute is measured by counting the ATen ops that execute during backward
(the recompute happens there) and by FLOPs, against the plain run's backward.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.module_tracker import ModuleTracker

import gradckpt
from gradckpt import policies
from gradckpt.measure import count_flops, count_ops

aten = torch.ops.aten
B = 4  # batch


class Block(nn.Module):
    """addmm (8->16), gelu, addmm (16->12), mm (12->4), tanh: distinct matmul sizes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 12)
        self.w3 = nn.Parameter(torch.randn(12, 4))
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        h = self.drop(torch.nn.functional.gelu(self.lin1(x)))
        return torch.tanh(self.lin2(h) @ self.w3)  # tanh saves its output: nothing is cut


FLOPS = {"lin1": 2 * B * 8 * 16, "lin2": 2 * B * 16 * 12, "w3": 2 * B * 12 * 4}


def _measure(backward):
    """Ops and FLOPs that execute while ``backward()`` runs (the recompute is in there)."""
    box = {}
    ops = count_ops(lambda: box.setdefault("flops", count_flops(backward)))
    return ops, box["flops"].total


def _step(model, policy, *, ckpt=True, backwards=1):
    """Forward outside the counters, backward(s) inside: returns grads, ops, FLOPs."""
    model.zero_grad(set_to_none=True)
    x = torch.randn(B, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(2)
    out = gradckpt.checkpoint(model, x, policy=policy) if ckpt else model(x)

    def backward():
        for i in range(backwards):
            out.sum().backward(retain_graph=i < backwards - 1)

    ops, flops = _measure(backward)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return grads, ops, flops


@pytest.fixture
def plain():
    return _step(Block(), None, ckpt=False)


def _recomputed(ours, plain, op):
    return ours[1][op] - plain[1][op]


def _grads_equal(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))


# -------------------------------------------------------------- stock policies


def test_no_policy_recomputes_every_matmul_once(plain):
    ours = _step(Block(), None)
    _grads_equal(ours, plain)
    assert _recomputed(ours, plain, "aten.addmm.default") == 2
    assert _recomputed(ours, plain, "aten.mm.default") == 1
    assert ours[2] - plain[2] == sum(FLOPS.values())


def test_recompute_all_recomputes_every_matmul_exactly_once(plain):
    ours = _step(Block(), policies.recompute_all)
    _grads_equal(ours, plain)
    assert _recomputed(ours, plain, "aten.addmm.default") == 2
    assert _recomputed(ours, plain, "aten.mm.default") == 1
    assert _recomputed(ours, plain, "aten.gelu.default") == 1
    assert ours[2] - plain[2] == sum(FLOPS.values())


def test_save_all_recomputes_nothing(plain):
    ours = _step(Block(), policies.save_all)
    _grads_equal(ours, plain)
    for op in ("aten.addmm.default", "aten.mm.default", "aten.gelu.default", "aten.tanh.default"):
        assert _recomputed(ours, plain, op) == 0, op
    assert ours[2] == plain[2]


def test_save_matmuls_recomputes_no_matmul_but_the_pointwise_ops(plain):
    ours = _step(Block(), policies.save_matmuls)
    _grads_equal(ours, plain)
    assert _recomputed(ours, plain, "aten.addmm.default") == 0
    assert _recomputed(ours, plain, "aten.mm.default") == 0
    assert _recomputed(ours, plain, "aten.gelu.default") == 1
    assert _recomputed(ours, plain, "aten.tanh.default") == 1
    assert ours[2] == plain[2]  # the recomputed ops (gelu, dropout, tanh) cost no FLOPs


def test_save_ops_flop_accounting_is_exact(plain):
    ours = _step(Block(), policies.save_ops(aten.addmm.default))
    _grads_equal(ours, plain)
    assert _recomputed(ours, plain, "aten.addmm.default") == 0
    assert _recomputed(ours, plain, "aten.mm.default") == 1
    assert ours[2] - plain[2] == FLOPS["w3"]


def test_save_indices_keeps_exactly_the_named_positions(plain):
    model = Block()
    x = torch.randn(B, 8)
    rows = policies.explain(policies.recompute_all, model, x)
    mm_at = [r["index"] for r in rows if r["op"] == "aten.mm.default"]
    ours = _step(model, policies.save_indices(mm_at))
    _grads_equal(ours, plain)
    assert _recomputed(ours, plain, "aten.mm.default") == 0
    assert ours[2] - plain[2] == FLOPS["lin1"] + FLOPS["lin2"]


def test_either_combines_policies(plain):
    policy = policies.either(
        policies.save_ops(aten.addmm.default), policies.save_ops(aten.mm.default)
    )
    ours = _step(Block(), policy)
    _grads_equal(ours, plain)
    assert ours[2] == plain[2]
    assert policy.__name__ == "either(save_ops(aten.addmm.default), save_ops(aten.mm.default))"
    with pytest.raises(ValueError, match="at least two"):
        policies.either(policies.save_all)
    with pytest.raises(TypeError, match="callables"):
        policies.either(policies.save_all, "save_all")


# ----------------------------------------------------- item 35: policy answers


def test_item35_bool_and_torch_checkpoint_policy_answers_are_accepted(
    plain,
):
    def as_bool(ctx, op, *args, **kwargs):
        return op in (aten.addmm.default, aten.mm.default)

    def as_torch(ctx, op, *args, **kwargs):
        keep = op in (aten.addmm.default, aten.mm.default)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    for policy in (as_bool, as_torch):
        ours = _step(Block(), policy)
        _grads_equal(ours, plain)
        assert ours[2] == plain[2]


@pytest.mark.parametrize("junk", ["yes", None, 1, torch.tensor(True)])
def test_item35_policy_returning_junk_raises_type_error_naming_the_op(junk):
    def policy(ctx, op, *args, **kwargs):
        return junk

    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(TypeError, match=r"policy policy returned .* for op aten\.sin\.default"):
        gradckpt.checkpoint(torch.sin, x, policy=policy)


def test_item35_save_ops_rejects_op_overload_packet():
    with pytest.raises(ValueError, match=r"aten\.mm.*\.default"):
        policies.save_ops(aten.mm)
    with pytest.raises(TypeError, match="op overloads"):
        policies.save_ops("aten.mm.default")


def test_item35_policy_factories_validate_eagerly():
    with pytest.raises(ValueError):
        policies.save_names()
    with pytest.raises(TypeError):
        policies.save_names("")
    with pytest.raises(ValueError):
        policies.save_indices([-1])


def test_item35_second_backward_keeps_policy_savings():
    """torch SAC allows one backward; our policies hold for every retain_graph pass."""
    plain = _step(Block(), None, ckpt=False, backwards=2)
    ours = _step(Block(), policies.save_matmuls, backwards=2)
    _grads_equal(ours, plain)
    assert _recomputed(ours, plain, "aten.addmm.default") == 0
    assert _recomputed(ours, plain, "aten.mm.default") == 0
    assert _recomputed(ours, plain, "aten.gelu.default") == 2  # once per backward

    model = Block()
    x = torch.randn(B, 8, requires_grad=True)
    keep = [aten.addmm.default, aten.mm.default]
    out = torch_checkpoint(
        model,
        x,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, keep),
    )
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        out.sum().backward()


# ------------------------------------------------------------ names and tags


class Tagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        h = gradckpt.tag(self.lin1(x), "h")
        return self.lin2(h.tanh()).tanh()


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)], ids=["2d", "3d"])
def test_save_names_keeps_the_tagged_op(shape):
    model = Tagged()
    x = torch.randn(*shape, requires_grad=True)
    model(x).sum().backward()
    plain_grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = gradckpt.checkpoint(model, x, policy=policies.save_names("h"))
    ops = count_ops(out.sum().backward)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    # lin1 (tagged) is not recomputed, lin2 is: one addmm in the recompute
    assert ops["aten.addmm.default"] == 1


def test_tag_finds_only_the_very_tensor_an_op_made_and_forgets_after_the_forward():
    # Producers are kept by id with a weak reference: an id reused by another
    # tensor after the first died must not name the dead tensor's op.
    frames = []

    def body(x):
        frame, running = gradckpt.engine.active_frame()
        made = x.sin()
        if running is not None:  # the recompute: nothing to check
            return made * x.cos()
        frames.append(frame)
        assert frame._producer(made) is not None
        key = next(iter(frame.producers))
        impostor = x.cos()
        frame.producers[id(impostor)] = (frame.producers[key][0], *frame.producers[key][1:])
        assert frame._producer(impostor) is None  # the reference is not to this tensor
        return made * impostor

    x = torch.randn(3, requires_grad=True)
    out = gradckpt.checkpoint(body, x, policy=policies.save_names("h"))
    assert frames[0].producers == {}  # tag() only applies while the forward runs
    out.sum().backward()


def test_tag_outside_a_region_returns_tensor_and_validates_name():
    t = torch.randn(2)
    assert gradckpt.tag(t, "x") is t
    with pytest.raises(TypeError, match="non-empty string"):
        gradckpt.tag(t, "")


# -------------------------------------------------------------------- explain


def test_explain_rows_describe_the_region():
    model = Block()
    x = torch.randn(B, 8)
    rows = policies.explain(policies.save_matmuls, model, x)
    assert [r["index"] for r in rows] == list(range(len(rows)))
    kept = [(r["op"], r["shapes"], r["bytes"]) for r in rows if r["decision"] == "save"]
    assert kept == [
        ("aten.addmm.default", [(B, 16)], B * 16 * 4),
        ("aten.addmm.default", [(B, 12)], B * 12 * 4),
        ("aten.mm.default", [(B, 4)], B * 4 * 4),
    ]
    ops = [r["op"] for r in rows]
    assert "aten.gelu.default" in ops and ops[-1] == "aten.tanh.default"
    assert {r["decision"] for r in rows} == {"save", "recompute"}


def test_explain_reports_views_as_recomputed_like_the_engine():
    rows = policies.explain(policies.save_all, Block(), torch.randn(B, 8))
    views = [r for r in rows if r["op"] == "aten.t.default"]
    assert len(views) == 2 and all(r["decision"] == "recompute" for r in views)
    assert all(r["decision"] == "save" for r in rows if r not in views)


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)], ids=["2d", "3d"])
def test_explain_shows_tag_decisions(shape):
    rows = policies.explain(policies.save_names("h"), Tagged(), torch.randn(*shape))
    saved = [(r["index"], r["op"]) for r in rows if r["decision"] == "save"]
    first_addmm = next(r["index"] for r in rows if r["op"] == "aten.addmm.default")
    assert saved == [(first_addmm, "aten.addmm.default")]


# ------------------------------------------------- SAVE'd output changed in place


def test_saved_output_modified_in_place_later_gives_correct_grads():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 6), nn.Tanh())
    x = torch.randn(4, 6, requires_grad=True)
    model(x).sum().backward()
    plain = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = gradckpt.checkpoint(model, x, policy=policies.save_matmuls)
    ops = count_ops(out.sum().backward)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))
    # The first addmm's kept output was changed by relu_, so it is recomputed;
    # the second one is replayed.
    assert ops["aten.addmm.default"] == 1


# ------------------------------------------- replay alignment under module hooks
#
# FlopCounterMode, torch's ModuleTracker and FSDP2 hook every module call and
# call register_multi_grad_hook on its inputs, which runs ``t.view_as(t)`` for a
# leaf that requires grad. A recompute's inputs are such leaves, so under these
# tools the recompute runs view ops its forward did not: kept outputs must still
# be replayed into the right ops (a stack of equal Linears makes a shifted replay
# type-check, giving silently wrong gradients).


def _linear_stack():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Tanh())


@pytest.mark.parametrize(
    "policy", [policies.save_all, policies.save_matmuls], ids=["save_all", "save_matmuls"]
)
@pytest.mark.parametrize("tool", ["flop_counter", "module_tracker"])
@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)], ids=["2d", "3d"])
def test_policy_replay_correct_when_backward_runs_under_module_hooks(policy, tool, shape):
    model = _linear_stack()
    x = torch.randn(*shape, requires_grad=True)
    _, plain_flops = _measure(model(x).sum().backward)
    plain = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = gradckpt.checkpoint(model, x, policy=policy)
    if tool == "flop_counter":
        ops, flops = _measure(out.sum().backward)
        assert ops["aten.addmm.default"] == 0  # kept matmuls are replayed, not rerun
        assert flops == plain_flops
    else:
        with ModuleTracker():
            out.sum().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))


def test_policy_savings_hold_for_non_leaf_region_input_under_module_tracker():
    """The usual case: a block's input is a non-leaf in the forward, a leaf in the recompute."""
    model = _linear_stack()
    x = torch.randn(4, 6, requires_grad=True)
    model(x * 2).sum().backward()
    plain = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    with ModuleTracker():
        out = gradckpt.checkpoint(model, x * 2, policy=policies.save_matmuls)
        ops = count_ops(out.sum().backward)
    assert ops["aten.addmm.default"] == 0
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))


def test_policy_replay_correct_when_recompute_runs_extra_ops():
    """A hook that appears only during backward runs ops the forward did not."""
    model = _linear_stack()
    x = torch.randn(4, 6, requires_grad=True)
    model(x).sum().backward()
    plain = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = gradckpt.checkpoint(model, x, policy=policies.save_all)
    stats = []

    def log_activations(module, args):
        with torch.no_grad():
            stats.append(args[0].abs().amax())

    handle = nn.modules.module.register_module_forward_pre_hook(log_activations)
    try:
        ops = count_ops(out.sum().backward)
    finally:
        handle.remove()
    assert len(stats) == 5  # the recompute called Sequential, 3 Linears and Tanh
    assert ops["aten.addmm.default"] == 0
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))
