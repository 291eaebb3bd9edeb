"""The lean path: a region that needs no per-op work recomputes on the saved-tensor hooks alone.

A region whose modules are known (a module, a module's method) and that keeps
no op outputs recomputes as torch's checkpoint does, with no dispatch mode;
its module side effects are undone per region (:mod:`gradckpt.engine.writes`).
A region that keeps op outputs, logs ops, or whose state is unknown recomputes
under ``RecomputeMode``. Either way the gradients are the plain run's and a
module's buffers are written once per step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import gradckpt
from gradckpt import policies
from gradckpt.engine.modes import RecomputeMode
from gradckpt.measure import count_ops


class Probe(nn.Module):
    """Records, at every call, whether a RecomputeMode is on the dispatch stack."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(
            any(isinstance(m, RecomputeMode) for m in _get_current_dispatch_mode_stack())
        )
        return torch.tanh(self.lin(x)).sin()


def _recompute_used_mode(call) -> bool:
    torch.manual_seed(0)
    probe = Probe()
    x = torch.randn(2, 4, requires_grad=True)
    call(probe, x).sum().backward()
    assert len(probe.seen) == 2  # the forward and one recompute
    assert probe.seen[0] is False  # the forward of a region without a policy: no mode
    return probe.seen[1]


@pytest.mark.parametrize(
    ("call", "per_op"),
    [
        (lambda m, x: gradckpt.checkpoint(m, x), False),
        (lambda m, x: gradckpt.checkpoint(m.forward, x), False),
        (lambda m, x: gradckpt.checkpoint(m, x, policy=policies.recompute_all), False),
        (lambda m, x: gradckpt.checkpoint_sequential([m, nn.Identity()], 2, x), False),
        (lambda m, x: gradckpt.checkpoint(lambda h: m(h), x), True),  # modules unknown
        (lambda m, x: gradckpt.checkpoint(m, x, policy=policies.save_matmuls), True),
        (lambda m, x: gradckpt.checkpoint(m, x, debug=True), True),
    ],
    ids=[
        "module",
        "method",
        "policy-keeps-nothing",
        "sequential",
        "function",
        "keeps-outputs",
        "debug",
    ],
)
def test_only_regions_that_need_per_op_work_recompute_under_the_mode(call, per_op):
    assert _recompute_used_mode(call) is per_op


def test_lean_and_per_op_recomputes_rerun_the_same_ops_as_torch():
    # Recompute asserted with op counts: the lean path reruns the whole region,
    # exactly what torch's checkpoint reruns.
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(3, 8, requires_grad=True)

    compute = ("aten.addmm.default", "aten.gelu.default", "aten.mm.default")

    def step(ckpt):
        ops = count_ops(lambda: ckpt(block, x).sum().backward())
        return {name: ops[name] for name in compute}  # the engine's own bookkeeping aside

    torch_ops = step(lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=False))
    assert step(gradckpt.checkpoint) == torch_ops
    assert step(lambda f, h: gradckpt.checkpoint(lambda t: f(t), h)) == torch_ops
    plain = count_ops(lambda: block(x).sum().backward())
    # The first Linear reruns; early stop ends the recompute once the last
    # Linear's inputs are saved again, before its own kernel.
    assert torch_ops["aten.addmm.default"] == plain["aten.addmm.default"] + 1
    assert torch_ops["aten.gelu.default"] == plain["aten.gelu.default"] + 1


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    inner = [nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU()) for _ in range(2)]
    return nn.Sequential(*inner)


def _stats_after(call) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    model = _bn_net()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = call(model, x)
    out.sum().backward(retain_graph=True)
    out.sum().backward()  # a second backward recomputes again
    return {k: b.clone() for k, b in model.named_buffers()}, [x.grad, *model.parameters()]


class PerBlock(nn.Module):
    """Checkpoints each of its blocks: a lean region nested in another when it is one too."""

    def __init__(self, blocks: nn.Sequential) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, h):
        for block in self.blocks:
            h = gradckpt.checkpoint(block, h)
        return h


def _nested_modules(model, x):
    return gradckpt.checkpoint(PerBlock(model), x)


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: gradckpt.checkpoint(m, x),
        _nested_modules,
        lambda m, x: gradckpt.checkpoint(lambda h: gradckpt.checkpoint(m, h), x),
    ],
    ids=["lean", "lean-in-lean", "lean-in-per-op"],
)
def test_batchnorm_statistics_written_once_on_every_path(call):
    # native_batch_norm writes running_mean/var without moving their versions:
    # the watch counts them as written whenever the module trains.
    plain, plain_grads = _stats_after(lambda m, x: m(x))
    got, grads = _stats_after(call)
    assert plain.keys() == got.keys()
    for key in plain:
        assert torch.equal(got[key], plain[key]), key
    assert got["0.1.num_batches_tracked"].item() == 1
    assert torch.equal(grads[0], plain_grads[0])


class WritesOutsideItsBuffers(nn.Module):
    """Writes a plain tensor attribute (not a registered buffer) in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = torch.zeros(())  # not a buffer: outside what the lean path restores

    def forward(self, x):
        self.calls.add_(1)
        return torch.tanh(self.lin(x))


def test_a_write_outside_the_module_s_buffers_is_repeated_by_a_lean_recompute_only():
    """The boundary of the lean path, written down: it restores buffers, not other tensors."""
    m = WritesOutsideItsBuffers()
    x = torch.randn(2, 4, requires_grad=True)
    gradckpt.checkpoint(lambda h: m(h), x).sum().backward()  # per op: writes aimed at copies
    assert m.calls.item() == 1
    gradckpt.checkpoint(m, x).sum().backward()  # lean: as torch's checkpoint
    assert m.calls.item() == 3
