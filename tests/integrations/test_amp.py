"""Mixed precision: bf16 autocast (CPU) planned and applied on transformers models.

The profile sees bf16 activation sizes, the fitted plan reproduces the plain
autocast run's gradients and stays within budget, and a region's recompute in
backward (which runs outside the ``autocast`` block) replays the autocast state
captured when the region started.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import gradckpt
from gradckpt.integrations import hf
from gradckpt.integrations.hf.zoo import hf_example, run_step
from gradckpt.planning import Plan, UnitChoice
from gradckpt.profiling import model_fingerprint

BF16 = torch.bfloat16
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}
# Many tokens per weight, so activations (not autocast's bf16 weight copies) dominate.
SIZES = dict(layers=2, batch=16, seq=16)
BUDGET = 0.8


pytestmark = pytest.mark.usefixtures("one_thread")


def _example(name: str, autocast: torch.dtype | None = BF16):
    ex = hf_example(name, autocast=autocast, **SIZES)
    hf.disable_cache(ex.model)
    return ex


def _saved_in_blocks(prof) -> tuple[int, int]:
    """(all, matmul-output) bytes of distinct storages the layers save for backward."""
    saved = {
        p.storage
        for p in prof.packs
        if p.storage >= 0 and p.unit >= 0 and prof.units[p.unit].is_block
    }
    total = sum(prof.storages[s].nbytes for s in saved)
    matmul = sum(
        prof.storages[s].nbytes
        for s in saved
        if prof.ops[prof.storages[s].producer].name in MATMULS
    )
    return total, matmul


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # bf16 tolerance (8 bits of mantissa); in practice the runs are bitwise equal.
    return a.keys() == b.keys() and all(
        torch.allclose(a[k], b[k], rtol=1e-2, atol=1e-3 * max(b[k].abs().max().item(), 1e-6))
        for k in a
    )


# Under autocast, transformers keeps some tensors in fp32 on purpose: Llama's
# RMSNorm upcasts, the residual stream stays fp32, and torch's CPU SDPA math path
# computes the softmax in fp32. Linear outputs are bf16, exactly half.
TOTAL_RATIO = {"gpt2": 0.72, "llama": 0.87}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_profile_sees_bf16_activation_sizes(name):
    sizes = {}
    for autocast in (None, BF16):
        ex = _example(name, autocast)
        prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
        sizes[autocast] = _saved_in_blocks(prof)
    (total32, mm32), (total16, mm16) = sizes[None], sizes[BF16]
    assert mm32 > 0 and mm16 * 2 == mm32
    assert total16 <= TOTAL_RATIO[name] * total32, (total16 / total32, name)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fit_under_autocast_matches_the_plain_autocast_run(name):
    ex = _example(name)
    plain = run_step(ex)
    assert plain.loss.dtype == torch.float32 and all(
        g.dtype == torch.float32 for g in plain.grads.values()
    )
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget=BUDGET, profiling=gradckpt.ProfileOptions(repeats=1))
    step = run_step(ex)
    gradckpt.remove(ex.model)
    # Something inside the blocks is checkpointed: a block unit that is not kept,
    # or a segment (a region over several units, whose own units may say keep).
    in_segment = {p for item in plan.items if isinstance(item, gradckpt.Segment) for p in item.paths}
    assert any(
        u.mode != "keep" or u.path in in_segment for u in plan.units if u.path in ex.block_paths
    )
    assert _close(step.grads, plain.grads)
    assert step.peak_bytes <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - step.peak_bytes) <= 0.05 * step.peak_bytes


class _MatmulDtypes(TorchDispatchMode):
    """Counts matmul outputs by op and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[tuple[str, torch.dtype]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in MATMULS:
            self.seen[(str(func), out.dtype)] += 1
        return out


def _backward_matmuls(ex) -> Counter[tuple[str, torch.dtype]]:
    torch.manual_seed(0)
    loss = ex.loss_fn()  # autocast ends with the forward
    with _MatmulDtypes() as mode:
        loss.backward()
    ex.model.zero_grad(set_to_none=True)
    return mode.seen


def test_recompute_in_backward_replays_autocast():
    ex = _example("gpt2")
    plain, plain_step = _backward_matmuls(ex), run_step(ex)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    every_layer = Plan(
        tuple(UnitChoice(u.path, "recompute" if u.is_block else "keep") for u in prof.units),
        model_fingerprint(ex.model),
    )
    gradckpt.apply(ex.model, every_layer)
    planned, step = _backward_matmuls(ex), run_step(ex)
    gradckpt.remove(ex.model)
    # GPT-2's linears are addmm, which only the forward runs (their backward is mm):
    # every addmm in backward is a recompute, and it must run in bf16 as the forward
    # did, although backward runs after the autocast block has ended.
    addmm = "aten.addmm.default"
    assert plain[(addmm, BF16)] == plain[(addmm, torch.float32)] == 0
    assert planned[(addmm, BF16)] > 0 and planned[(addmm, torch.float32)] == 0
    assert _close(step.grads, plain_step.grads)


def test_transformers_switch_under_autocast():
    ex = _example("llama")
    plain = run_step(ex)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.enable(ex.model, policy=gradckpt.policies.save_matmuls)
    step = run_step(ex)
    hf.disable(ex.model)
    assert _close(step.grads, plain.grads)
    assert step.peak_bytes < plain.peak_bytes
