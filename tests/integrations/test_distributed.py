"""FSDP2 and DDP on 2 CPU ranks (gloo): same gradients as one process, per-rank peak in budget.

The ranks are this file run as a script (``python test_distributed.py SCENARIO
OUT``) in two subprocesses on a free loopback port, with a timeout; each
writes its results with ``torch.save`` and the tests compare them with a
single-process reference. Each rank trains on its half of the batch with its
own dropout seed, so the reference runs both halves with those seeds and
averages the gradients (what the collectives compute).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import gradckpt
from gradckpt.integrations.distributed import rank_memory, rank_profile
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.profiling import model_fingerprint
from gradckpt.testing import make

WORLD = 2
GPT = dict(layers=4, d_model=64, heads=4, seq=32, vocab=512, batch=8, dropout=0.1)
FSDP_BUDGET = 0.6  # of the per-rank plain peak the planner predicts
TIMEOUT_S = 240
ATOL = 1e-5


def _seed(step: int, rank: int) -> int:
    return 1000 + 10 * step + rank


def _half_loss(ex, rank: int, world: int = WORLD):
    """One rank's loss: its contiguous share of the batch."""
    idx, targets = ex.inputs["idx"], ex.inputs["targets"]
    share = idx.shape[0] // world
    rows = slice(rank * share, (rank + 1) * share)

    def loss_fn():
        logits = ex.model(idx[rows])
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets[rows].reshape(-1))

    return loss_fn


# ------------------------------------------------------------------ the ranks


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _segment_plan(ex) -> Plan:
    items = [UnitChoice(p) for p in ("tok_emb", "pos_emb", "drop")]
    items.append(Segment(tuple(UnitChoice(p) for p in ex.block_paths[:2])))
    items += [UnitChoice(p, "recompute") for p in ex.block_paths[2:]]
    items += [UnitChoice("ln_f"), UnitChoice("lm_head")]
    return Plan(tuple(items), model_fingerprint(ex.model))


def _fsdp_rank(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from gradckpt.integrations.distributed import RankMemoryTracker, fit_for_fsdp

    def shard(model):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    out: dict = {}
    # The plain model under FSDP: its per-rank peak is what the budget must cut.
    plain = make("gpt", **GPT)
    shard(plain.model)
    for _ in range(2):
        plain.model.zero_grad(set_to_none=True)
        with RankMemoryTracker(plain.model) as tracker:
            _half_loss(plain, rank, world)().backward()
    out["plain_peak"] = tracker.peak_bytes

    ex = make("gpt", **GPT)
    loss_fn = _half_loss(ex, rank, world)
    plan = fit_for_fsdp(ex.model, loss_fn, FSDP_BUDGET, repeats=1)
    out["plan"] = plan.to_json()
    shard(ex.model)
    for step in range(2):  # the first step lets FSDP create its gather buffers
        ex.model.zero_grad(set_to_none=True)
        torch.manual_seed(_seed(step, rank))
        with RankMemoryTracker(ex.model) as tracker:
            loss = loss_fn()
            loss.backward()
    out["peak"] = tracker.peak_bytes
    out["loss"] = loss.detach()
    grads = {k: _full(p.grad) for k, p in ex.model.named_parameters()}  # collective
    if rank == 0:
        out["grads"] = grads

    # A plan with a segment is refused on a sharded model: by apply, and at run time.
    late = make("gpt", **GPT)
    shard(late.model)
    try:
        gradckpt.apply(late.model, _segment_plan(make("gpt", **GPT)))
    except ValueError as exc:
        out["apply_error"] = str(exc)
    early = make("gpt", **GPT)
    gradckpt.apply(early.model, _segment_plan(early))
    shard(early.model)
    try:
        _half_loss(early, rank, world)().backward()
    except gradckpt.CheckpointError as exc:
        out["run_error"] = str(exc)
    return out


def _ddp_rank(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradckpt.integrations.distributed import fit_for_ddp

    out: dict = {}
    configs = {
        # sqrt: segments; find_unused_parameters walks the graph each step.
        "find_unused": (1.0, dict(solver="sqrt"), dict(find_unused_parameters=True)),
        # DDP's sink skips a chunked head's lazy logits: plan without chunking.
        "static_graph": (0.6, dict(chunking=False), dict(static_graph=True)),
        # Plain DDP synchronises a chunked head's gradients as any other.
        "chunked": (0.6, dict(), dict()),
    }
    for name, (budget, plan_options, ddp_options) in configs.items():
        ex = make("gpt", **GPT)
        loss_fn = _half_loss(ex, rank, world)
        plan = fit_for_ddp(ex.model, loss_fn, budget, repeats=1, **plan_options)
        model = DDP(ex.model, **ddp_options)
        idx, targets = ex.inputs["idx"], ex.inputs["targets"]
        share = idx.shape[0] // world
        rows = slice(rank * share, (rank + 1) * share)
        for step in range(3):  # "marked ready twice" would show from the second step
            model.zero_grad(set_to_none=True)
            torch.manual_seed(_seed(step, rank))
            logits = model(idx[rows])
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets[rows].reshape(-1))
            loss.backward()
        out[name] = {
            "plan": plan.to_json(),
            "grads": {k: p.grad.clone() for k, p in ex.model.named_parameters()},
        }
    # A chunked head under DDP's static graph is refused at its first call.
    ex = make("gpt", **GPT)
    fit_for_ddp(ex.model, _half_loss(ex, rank, world), 0.6, repeats=1)
    model = DDP(ex.model, static_graph=True)
    try:
        model(ex.inputs["idx"][:2])
    except gradckpt.CheckpointError as exc:
        out["static_chunk_error"] = str(exc)
    return out


def _main(scenario: str, out_dir: str) -> None:
    from _ranks import run_rank

    run_rank({"fsdp": _fsdp_rank, "ddp": _ddp_rank}[scenario], out_dir)


# ------------------------------------------------------------------ launching


def _reference(step: int) -> tuple[dict, list[torch.Tensor]]:
    """Single process: both ranks' halves with their seeds, gradients averaged."""
    ex = make("gpt", **GPT)
    ex.model.zero_grad(set_to_none=True)
    losses = []
    for rank in range(WORLD):
        torch.manual_seed(_seed(step, rank))
        loss = _half_loss(ex, rank)() / WORLD
        loss.backward()
        losses.append(loss.detach() * WORLD)
    return {k: p.grad.clone() for k, p in ex.model.named_parameters()}, losses


def _assert_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=0, msg=k)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, launch_ranks):
    pytest.importorskip("torch.distributed.fsdp")
    out_dir = tmp_path_factory.mktemp("fsdp")
    return launch_ranks(__file__, ["fsdp", str(out_dir)], out_dir, WORLD, TIMEOUT_S)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, launch_ranks):
    out_dir = tmp_path_factory.mktemp("ddp")
    return launch_ranks(__file__, ["ddp", str(out_dir)], out_dir, WORLD, TIMEOUT_S)


# --------------------------------------------------------------------- tests


def test_fsdp_ranks_run_one_segment_free_plan_that_checkpoints(fsdp):
    plans = [Plan.from_json(r["plan"]) for r in fsdp]
    assert plans[0] == plans[1]  # made on rank 0, broadcast
    assert not any(isinstance(item, Segment) for item in plans[0].items)
    assert any(u.mode != "keep" for u in plans[0].units)


def test_fsdp_gradients_equal_the_single_process_ones(fsdp):
    want, losses = _reference(step=1)
    _assert_grads(fsdp[0]["grads"], want)
    for rank in range(WORLD):
        torch.testing.assert_close(fsdp[rank]["loss"], losses[rank], atol=ATOL, rtol=0)


def test_fsdp_measured_per_rank_peak_stays_within_the_budget(fsdp):
    for result in fsdp:
        plan = Plan.from_json(result["plan"])
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        assert result["peak"] <= plan.budget_bytes
        assert result["plain_peak"] > plan.budget_bytes  # the budget binds on this rank


def test_fsdp_refuses_plans_with_segments(fsdp):
    for result in fsdp:
        assert "FSDP shards" in result["apply_error"]
        assert "segments=False" in result["run_error"]


def test_ddp_gradients_equal_the_single_process_ones(ddp):
    want, _ = _reference(step=2)
    chunked = Plan.from_json(ddp[0]["chunked"]["plan"])
    assert any(u.mode == "chunk" for u in chunked.units)
    for result in ddp:
        assert "static_graph=True" in result["static_chunk_error"]
        assert "chunking=False" in result["static_chunk_error"]
    for name in ("find_unused", "static_graph", "chunked"):
        plans = [Plan.from_json(r[name]["plan"]) for r in ddp]
        assert plans[0] == plans[1]
        for result in ddp:
            _assert_grads(result[name]["grads"], want)
    sqrt = Plan.from_json(ddp[0]["find_unused"]["plan"])
    assert any(isinstance(item, Segment) for item in sqrt.items)


# -------------------------------------------------- per-rank accounting (1 process)


def test_rank_memory_shards_parameters_and_adds_the_gathered_groups():
    ex = make("gpt", **GPT)
    model = ex.model
    full = sum(p.numel() * 4 for p in model.parameters())
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    root = full - len(model.blocks) * block  # embeddings (tied head) and final norm
    memory = rank_memory(model, 4)
    assert memory.full_param_bytes == full
    assert (
        full / 4 <= memory.sharded_param_bytes <= full / 4 + 4 * 64 * len(list(model.parameters()))
    )
    assert memory.root_gathered_bytes == root
    assert memory.largest_group_bytes == block
    assert memory.param_bytes == memory.sharded_param_bytes + root + 3 * block
    single = rank_memory(model, 1)
    assert single.param_bytes == full


def test_rank_profile_moves_only_the_parameter_bytes():
    ex = make("gpt", **GPT)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    memory = rank_memory(ex.model, WORLD)
    per_rank = rank_profile(prof, memory)
    assert per_rank.param_bytes == memory.param_bytes
    shift = memory.param_bytes - prof.param_bytes
    assert per_rank.measured_peak_bytes == prof.measured_peak_bytes + shift
    plan = gradckpt.plan(ex.model, ex.loss_fn, 0.7, profiling=gradckpt.ProfileOptions(profile=prof))
    assert gradckpt.simulate(per_rank, plan).peak_bytes == (
        gradckpt.simulate(prof, plan).peak_bytes + shift
    )


def test_segments_false_makes_segment_free_plans_and_refuses_sqrt():
    ex = make("mlp", blocks=8, width=32, hidden=128, batch=1024)  # activations dominate
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    every_block = gradckpt.plan(ex.model, ex.loss_fn, 1.0, profiling=gradckpt.ProfileOptions(profile=prof), solver="every_block")
    below = (every_block.predicted_peak_bytes * 19) // 20  # only segments reach below it
    with_segments = gradckpt.plan(ex.model, ex.loss_fn, below, profiling=gradckpt.ProfileOptions(profile=prof))
    assert any(isinstance(item, Segment) for item in with_segments.items)
    with pytest.raises(gradckpt.BudgetError):  # refused, not silently segmented
        gradckpt.plan(ex.model, ex.loss_fn, below, profiling=gradckpt.ProfileOptions(profile=prof), segments=False)
    for share in (1.0, 1.2):
        budget = int(every_block.predicted_peak_bytes * share)
        plan = gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof), segments=False)
        assert not any(isinstance(item, Segment) for item in plan.items)
        assert plan.predicted_peak_bytes <= budget
    with pytest.raises(ValueError, match="segments=False"):
        gradckpt.plan(ex.model, ex.loss_fn, 1.0, profiling=gradckpt.ProfileOptions(profile=prof), solver="sqrt", segments=False)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
