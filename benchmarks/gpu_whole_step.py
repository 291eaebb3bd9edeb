"""gpu_check's whole-step stage: the budget as the device, on CUDA (issue 25).

For the GPT of ``gradckpt.testing`` with AdamW, accumulation 1 and 4: plan the
whole training step for 0.6 of its plain whole-step peak (or halfway from the
least peak, where 0.6 is out of reach) with ``gradckpt.fit``,
train 3 steps, and report the allocator's *allocated* high-water (what the
prediction models) and its *reserved* high-water (what an out-of-memory error
sees: the caching allocator's segments), each against the budget, from the
call that plans to the end of the last step. Also ``budget="auto"``'s reading of
the device (its rule and headroom). On CPU (``--cpu-dry-run``) reserved bytes do
not exist and read None.

Example:
    >>> print(run_whole_step_check(dry=True, device="cpu", log=print))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import gradckpt
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.measure.device import device_memory
from gradckpt.testing import make

__all__ = ["run_whole_step_check"]

_SIZES = {
    True: dict(layers=2, d_model=64, seq=64, batch=2),
    False: dict(layers=12, d_model=1024, heads=16, seq=1024, vocab=8192, batch=4),
}


def _train(model, loss_fn, opt, k: int, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(k):
            loss_fn().backward()
        opt.step()


def _one(dry: bool, device: str, k: int, log: Callable[[str], None]) -> str:
    ex = make("gpt", device=device, **_SIZES[dry])
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-4)
    whole = gradckpt.profile(ex.model, ex.loss_fn, optimizer=opt, accumulation_steps=k, fake=True)
    # 0.6 of the plain peak, or halfway to it from the least peak where 0.6 is out of reach.
    least = gradckpt.Planner(whole).least_peak()[1].peak_bytes
    budget = max(int(0.6 * whole.measured_peak_bytes), (least + whole.measured_peak_bytes) // 2)
    with AllocatorTracker(device) as everything:
        plan = gradckpt.fit(ex.model, ex.loss_fn, budget, step=gradckpt.StepOptions(optimizer=opt, accumulation_steps=k))
        with AllocatorTracker(device) as steps:
            _train(ex.model, ex.loss_fn, opt, k, 3)
    params = state_bytes(ex.model)
    allocated = params + everything.peak_bytes
    reserved = None
    if everything.reserved_peak_bytes is not None:
        reserved = params + everything.reserved_peak_bytes
    measured = params + steps.peak_bytes
    error = (plan.predicted_peak_bytes - measured) / measured
    line = (
        f"whole step K={k}: budget {budget / 2**20:.1f} MiB; predicted "
        f"{plan.predicted_peak_bytes / 2**20:.1f} MiB ({plan.step.phase}), measured allocated "
        f"{measured / 2**20:.1f} MiB ({error:+.2%}); high-water from planning on: allocated "
        f"{allocated / 2**20:.1f} MiB ({'within' if allocated <= budget else 'OVER'} budget)"
        + (
            f", reserved {reserved / 2**20:.1f} MiB ({'within' if reserved <= budget else 'OVER'})"
            if reserved is not None
            else ", reserved n/a"
        )
    )
    log(f"  {line}")
    return line


def run_whole_step_check(dry: bool, device: str, log: Callable[[str], None]) -> str:
    """One note: the whole-step budget held on ``device`` (allocated and reserved), and auto."""
    lines = [_one(dry, device, k, log) for k in (1, 4)]
    where = torch.device(device)
    auto = device_memory(where if where.type == "cuda" else "cpu")
    lines.append(auto.line())
    log(f"  {auto.line()}")
    return "; ".join(lines)
