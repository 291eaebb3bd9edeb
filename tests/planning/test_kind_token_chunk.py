"""MLP chunking (#41 item 3): which modules are token-wise, when the planner chunks them,
what it predicts, and a real run at the allocator.

A toy transformer-like stack: each block has a token *mixer* (a linear map over the
sequence axis, so a token's output reads every token) and an MLP 4x wide. The MLP
is token-wise and offered; the mixer is not (its matmul's rows are channels, not
tokens), and neither is an MLP with dropout (slices would draw other masks).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.planning import Plan
from gradckpt.planning.kinds.chunk.token_plan import (
    TOKEN_CHOICES,
    allow_token_chunking,
    fewest_chunked,
    with_token_chunks,
)
from gradckpt.planning.kinds.chunk.token_wise import token_wise_spans
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.errors import PlanFormatError
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.baselines import every_kth_plan, none_plan, save_matmuls_plan

H, T = 32, 256


class Mixer(nn.Module):
    """A linear map over the tokens (or, ``mean``: each token plus the mean of all)."""

    def __init__(self, seq: int, mean: bool = False) -> None:
        super().__init__()
        self.over_tokens = nn.Linear(seq, seq)
        self.mean = mean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean:  # only row-wise kinds of ops, but the mean's rows are not tokens
            return 2 * x + x.mean(1, keepdim=True)
        return self.over_tokens(x.transpose(1, 2)).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, seq: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.mix, self.mlp = Mixer(seq), MLP(H, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self, seq: int = T, dropout: float = 0.0, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(seq, dropout) for _ in range(layers))
        self.head = nn.Linear(H, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _example(seq: int = T, dropout: float = 0.0):
    torch.manual_seed(0)
    net = Net(seq, dropout)
    x = torch.randn(2, seq, H)
    return net, lambda: net(x).square().mean()


def _step(net, loss_fn):
    net.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with AllocatorTracker() as allocator:
        loss = loss_fn()
        loss.backward()
    grads = {k: p.grad.clone() for k, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    return state_bytes(net) + allocator.peak_bytes, loss.detach(), grads


def _step_under(net, loss_fn, plan):
    gradckpt.apply(net, plan)
    try:
        return _step(net, loss_fn)
    finally:
        gradckpt.remove(net)


@pytest.fixture(scope="module")
def toy():
    net, loss_fn = _example()
    return net, loss_fn, gradckpt.profile(net, loss_fn, repeats=1)


def test_the_mlp_is_token_wise_and_the_token_mixer_is_not(toy):
    _, _, prof = toy
    spans, why_not = token_wise_spans(prof)
    assert sorted(spans) == [f"blocks.{i}.mlp" for i in range(3)]
    assert all(s.rows == 2 * T for s in spans.values())
    assert "transpose" in why_not["blocks.0.mix"]


def test_a_mixer_made_of_row_wise_ops_is_refused_by_its_rows():
    net, loss_fn = _example()
    for block in net.blocks:
        block.mix.mean = True
    spans, why_not = token_wise_spans(gradckpt.profile(net, loss_fn, repeats=1))
    assert "blocks.0.mix" not in spans and "blocks.0.mlp" in spans
    assert "mixes or reduces" in why_not["blocks.0.mix"]


def test_an_mlp_with_dropout_is_not_offered():
    net, loss_fn = _example(dropout=0.1)
    prof = gradckpt.profile(net, loss_fn, repeats=1)
    spans, why_not = token_wise_spans(prof)
    assert not spans
    assert "random" in why_not["blocks.0.mlp"]
    plan, _ = Planner(prof).least_peak()
    assert plan.token_chunks == ()


def test_chunking_false_forbids_it_and_plans_without_it_are_written_as_before(toy):
    _, _, prof = toy
    plan, _ = Planner(prof, chunking=False).least_peak()
    assert plan.token_chunks == ()
    data = plan.to_json()
    assert "token_chunks" not in data and data["version"] == 1
    with allow_token_chunking(False):
        head_only, _ = Planner(prof).least_peak()
    assert head_only.token_chunks == ()


def test_the_planner_chunks_mlps_below_the_least_peak_without(toy):
    _, _, prof = toy
    with allow_token_chunking(False):
        _, without = Planner(prof).least_peak()
    plan, pred = Planner(prof).least_peak()
    assert plan.token_chunks and pred.peak_bytes < without.peak_bytes
    assert "mlp chunk" in plan.summary() and "order of sums" in plan.summary()
    # A budget between the two is met only by chunking MLPs, and planned so.
    budget = (pred.peak_bytes + without.peak_bytes) // 2
    fitted = Planner(prof).plan(budget)
    assert fitted.token_chunks and fitted.predicted_peak_bytes <= budget
    # Chunking costs time: one more forward of each chunked MLP.
    assert simulate(prof, fitted).recompute_time > 0


def test_just_below_the_floor_only_the_mlps_that_set_it_are_chunked(toy):
    # A few bytes below the least peak without chunking, one block's backward is over:
    # chunking every MLP would pay each one's recompute and slices for that.
    _, _, prof = toy
    with allow_token_chunking(False):
        base, without = Planner(prof).least_peak()
    budget = without.peak_bytes - 1
    for k in TOKEN_CHOICES:
        every = with_token_chunks(prof, base, k)
        fewest = fewest_chunked(prof, base, k, budget)
        assert fewest is not None and simulate(prof, fewest).peak_bytes <= budget
        assert set(fewest.token_chunks) < set(every.token_chunks)
        assert simulate(prof, fewest).step_time < simulate(prof, every).step_time


def test_the_planner_chunks_no_more_than_the_budget_needs(toy):
    # Its plan leaves unchunked the MLPs its base can keep whole (the planner chunked
    # every one of them before), and is at least as fast as any plan chunking every MLP
    # of the leanest plan.
    _, _, prof = toy
    with allow_token_chunking(False):
        base, without = Planner(prof).least_peak()
    budget = without.peak_bytes - 1
    plan = Planner(prof).plan(budget)
    pred = simulate(prof, plan)
    assert plan.token_chunks and pred.peak_bytes <= budget
    k = plan.token_chunks[0][1]
    all_of_base = with_token_chunks(prof, dataclasses.replace(plan, token_chunks=()), k)
    assert set(plan.token_chunks) < set(all_of_base.token_chunks)
    assert pred.step_time < simulate(prof, all_of_base).step_time
    every = [simulate(prof, with_token_chunks(prof, base, k)) for k in TOKEN_CHOICES]
    fitting = [p.step_time for p in every if p.peak_bytes <= budget]
    assert fitting and pred.step_time <= min(fitting)


def test_a_plan_file_with_token_chunks_is_version_2_and_reads_back(toy, tmp_path):
    _, _, prof = toy
    plan, _ = Planner(prof).least_peak()
    plan.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["version"] == 2
    assert Plan.load(tmp_path / "plan.json").token_chunks == plan.token_chunks
    data = plan.to_json()
    data["token_chunks"] = [["blocks.0.mlp", "many"]]
    with pytest.raises(PlanFormatError, match="token_chunks"):
        Plan.from_json(data)


# Blocks kept (the MLP a region of its own) or recomputed (nested in the block's);
# 500 rows in 7 slices: uneven.
@pytest.mark.parametrize("seq,chunks,base", [(T, 4, "keep"), (250, 7, "recompute")])
def test_a_chunked_plan_measures_what_it_predicts_and_gradients_match(
    seq, chunks, base, one_thread
):
    net, loss_fn = _example(seq)
    plain_peak, plain_loss, plain_grads = _step(net, loss_fn)
    prof = gradckpt.profile(net, loss_fn, repeats=1)
    plain = none_plan(prof) if base == "keep" else every_kth_plan(prof, 1)
    plan = with_token_chunks(prof, plain, chunks)
    assert len(plan.token_chunks) == 3
    pred = simulate(prof, plan)
    peak, loss, grads = _step_under(net, loss_fn, plan)
    assert peak < plain_peak
    assert abs(pred.peak_bytes - peak) <= 0.02 * peak, (pred.peak_bytes, peak)
    assert abs(loss - plain_loss) <= 1e-5 * abs(plain_loss)
    for k, ref in plain_grads.items():
        assert (grads[k] - ref).norm() <= 1e-5 * ref.norm(), k


class _WideBlock(nn.Module):
    """A residual MLP 8x wide: over few tokens its weights' gradients are a large share
    of what its backward holds."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(width), MLP(width)
        self.mlp.up, self.mlp.down = nn.Linear(width, 8 * width), nn.Linear(8 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _WideMLPNet(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_WideBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("base", ["keep", "recompute"])
def test_the_weights_gradients_of_a_chunked_mlp_are_counted_from_its_first_slice(
    base, one_thread
):
    # Autograd gathers each slice's weight gradient before handing it on: the whole
    # gradient lives from the first slice's backward (measured 15% over the prediction
    # when the simulator counted it where the plain step makes it).
    torch.manual_seed(0)
    net, x = _WideMLPNet(), torch.randn(2, 32, 64)

    def loss_fn():
        return net(x).square().mean()

    prof = gradckpt.profile(net, loss_fn, repeats=1)
    plain = none_plan(prof) if base == "keep" else every_kth_plan(prof, 1)
    plan = with_token_chunks(prof, plain, 2)
    assert plan.token_chunks
    pred = simulate(prof, plan)
    peak, _, _ = _step_under(net, loss_fn, plan)
    assert peak <= pred.peak_bytes <= 1.05 * peak, (pred.peak_bytes, peak)


def test_explain_says_which_mlps_run_in_slices(toy):
    _, _, prof = toy
    plan = with_token_chunks(prof, none_plan(prof), 4)
    explained = Planner(prof).explain(plan=plan)
    text = explained.table()
    assert "in 4 slices of chunked MLP blocks.0.mlp" in text
    # The kept blocks' other saved tensors are still kept, not called recomputed.
    mix = [r for r in explained.rows if r.unit == "blocks.0" and r.status == "kept"]
    assert mix
    units = {u.path: u for u in explained.units}
    assert "MLP blocks.0.mlp in 4 slices" in units["blocks.0"].decision


def test_apply_refuses_an_mlp_in_slices_inside_a_selective_block(toy):
    net, _, prof = toy
    base = save_matmuls_plan(prof)
    selective = [u.path for u in base.units if u.mode == "selective"]
    assert selective
    plan = dataclasses.replace(base, token_chunks=((f"{selective[0]}.mlp", 4),))
    with pytest.raises(ValueError, match="only a kept or recomputed block"):
        gradckpt.apply(net, plan)
    assert "forward" not in net.blocks[0].mlp.__dict__  # nothing left installed


@pytest.mark.parametrize("base", ["keep", "recompute"])
@pytest.mark.parametrize("chunks", [2, 4])
def test_a_chunked_mlps_recompute_flops_are_what_the_step_runs(base, chunks):
    """Recompute FLOPs predicted for MLPs in slices equal the matmul FLOPs the step runs
    beyond the plain one. Inside a recomputed block the slices before the last rerun
    whole, the second linear too (the block reaches its last saved tensor only in the
    last slice): without that the prediction was short by (k-1)/k of it."""
    from gradckpt.measure.flops import count_matmul_flops

    net, loss_fn = _example()
    prof = gradckpt.profile(net, loss_fn, repeats=1)
    plan = with_token_chunks(prof, none_plan(prof) if base == "keep" else every_kth_plan(prof, 1), chunks)
    step = lambda: loss_fn().backward()  # noqa: E731
    plain = count_matmul_flops(step)
    gradckpt.apply(net, plan)
    try:
        ran = count_matmul_flops(step)
    finally:
        gradckpt.remove(net)
        net.zero_grad(set_to_none=True)
    assert ran - plain == simulate(prof, plan).recompute_flops


def test_a_kept_blocks_mlp_slices_pay_the_host_cost_of_their_ops_again():
    """Each slice beyond the first reruns the MLP's forward and backward ops on fewer
    tokens: priced as ``sliced_ops`` (the host's per-op cost), forward and backward."""
    net, loss_fn = _example()
    prof = gradckpt.profile(net, loss_fn, repeats=1)
    spans = token_wise_spans(prof)[0]
    plain = simulate(prof, none_plan(prof)).engine_counts.sliced_ops
    for chunks in (2, 4):
        plan = with_token_chunks(prof, none_plan(prof), chunks)
        per_slice = sum(
            (spans[path].end_op - spans[path].first_op) + spans[path].backward_ops
            for path, _ in plan.token_chunks
        )
        assert all(spans[path].backward_ops > 0 for path, _ in plan.token_chunks)
        assert simulate(prof, plan).engine_counts.sliced_ops - plain == (chunks - 1) * per_slice
