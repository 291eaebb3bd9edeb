"""``gradckpt.tune``: the micro-batch size and the plan that train fastest in the budget.

1. **Candidates**: the divisors of ``global_batch`` up to 4096 (``batch_sizes``
   if given; without a global batch, powers of two up to the largest whose
   leanest plan fits); the bounds are checked before any work
   (:mod:`gradckpt.tuning.sizes`). Each is profiled under fake tensors (exact
   sizes, no memory).
2. **Times**: the plain step profiled for real at the two smallest sizes that
   fit the budget plainly (:mod:`gradckpt.tuning.timing`); the optimizer's step
   timed once. Nothing runs above the budget.
3. **Predict** (:mod:`gradckpt.tuning.predict`): every size under no
   checkpointing, per-layer checkpointing and gradckpt's plan, in whole-step
   bytes (optimizer state, accumulation), and samples per second.
4. **Check by running** (:mod:`gradckpt.tuning.run`): the ``top`` gradckpt
   candidates predicted fastest, the largest micro-batch without checkpointing
   and the largest with per-layer checkpointing run real steps, interleaved;
   the fastest measured within the budget is chosen (the predicted best is kept
   unless another is faster in every round by more than 3%).

Example:
    >>> result = gradckpt.tune(model, sliced_loss(model, batch), "12GiB",
    ...                        optimizer=opt, global_batch=64)
    >>> print(result.table()); result.apply(model)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from gradckpt.api.budget import (
    annotated,
    check_step_arguments,
    held_bytes,
    resolve_budget,
    training_step,
)
from gradckpt.apply.select import pick_fastest
from gradckpt.measure.beside import malloc_in_use, warn_tensors_only
from gradckpt.measure.outside import suspended
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.solving.budget import BudgetError, read_budget
from gradckpt.planning.solving.whole_step import with_training_step
from gradckpt.profiling.records import Profile
from gradckpt.profiling.run import profile as profile_step
from gradckpt.profiling.training_step import TrainingStep
from gradckpt.profiling.units import BlockSpec
from gradckpt.tuning.batches import MakeLoss
from gradckpt.tuning.predict import fake_profile, predict_candidates
from gradckpt.tuning.result import TuneCandidate, TuneResult
from gradckpt.tuning.run import optimizer_seconds, run_candidates
from gradckpt.tuning.sizes import LARGEST_MICRO_BATCH, candidate_sizes, check_counts
from gradckpt.tuning.timing import BatchTimes

__all__ = ["tune"]


def tune(
    model: nn.Module,
    make_loss: MakeLoss,
    budget: int | str,
    *,
    optimizer: Any = None,
    global_batch: int | None = None,
    batch_sizes: Sequence[int] | None = None,
    set_to_none: bool = True,
    top: int = 2,
    rounds: int = 3,
    blocks: BlockSpec = None,
    progress: Callable[[str], None] | None = None,
) -> TuneResult:
    """The micro-batch, accumulation and plan with the most samples per second in ``budget``.

    Args:
        model: the model to train.
        make_loss: ``make_loss(b)`` returns a zero-argument loss for a micro-batch of
            ``b`` samples (:func:`gradckpt.tuning.sliced_loss` makes one from a batch).
        budget: bytes, a string with units or ``"auto"``: the whole training step's
            (a fraction of a plain peak means nothing across micro-batch sizes).
        optimizer: what you train with (see :func:`gradckpt.plan`); None: not counted.
        global_batch: samples per optimizer step; each micro-batch size ``b`` divides it
            and runs ``global_batch / b`` accumulation steps. None: one micro-batch per
            step, the size free.
        batch_sizes: the micro-batch sizes to consider (default: see the module doc).
        set_to_none: gradients cleared with ``zero_grad(set_to_none=True)``.
        top: gradckpt candidates measured, besides the largest plain and per-layer ones.
        rounds: real runs per measured candidate.
        blocks: the model's repeated blocks, if not found automatically.
        progress: called with one line per candidate predicted and per candidate run
            (the CLI prints them).

    Returns:
        A :class:`TuneResult`; ``result.apply(model)`` installs its plan.

    Raises:
        BudgetError: no candidate fits the budget.
        ValueError: an argument out of its bounds (:mod:`gradckpt.tuning.sizes`), before
            anything is profiled.

    Example:
        >>> result = gradckpt.tune(model, make_loss, "auto", optimizer="adamw", global_batch=32)
    """
    if read_budget(budget)[0] == "fraction":
        raise ValueError(
            "tune needs the budget in bytes or 'auto': a fraction of the plain peak differs "
            "for every micro-batch size"
        )
    check_step_arguments(optimizer, 1, set_to_none)
    check_counts(top=top, rounds=rounds)
    sizes = candidate_sizes(global_batch, batch_sizes)
    started = time.perf_counter()
    since = malloc_in_use()  # what tuning then holds (kernel caches of new sizes) counts too
    step1 = training_step(model, optimizer, 1, set_to_none) or TrainingStep()
    resolved, device = resolve_budget(model, budget, optimizer)
    budget_bytes = int(read_budget(resolved)[1])

    def accumulation(b: int) -> int:
        return global_batch // b if global_batch is not None else 1

    def samples(b: int) -> int:
        return global_batch if global_batch is not None else b

    def step_for(b: int) -> TrainingStep:
        return replace(step1, accumulation_steps=accumulation(b))

    held = held_bytes(model, optimizer)
    fakes = _fake_profiles(model, make_loss, sizes, step_for, budget_bytes, blocks)
    times = _real_times(model, make_loss, fakes, held, budget_bytes, blocks, since)
    opt_seconds = (
        optimizer_seconds(model, make_loss(times.real[0][0]), optimizer) if times.real else 0.0
    )
    rows = predict_candidates(fakes, step_for, budget_bytes, times, opt_seconds, samples)
    planning = time.perf_counter() - started
    say = progress or (lambda line: None)
    for b in sorted(fakes):
        parts = [_said(r) for r in rows if r.micro_batch == b]
        say(f"micro-batch {b} x {accumulation(b)}: " + "; ".join(parts))
    picked = _to_measure(rows, top)
    if not picked:
        least = min((r.predicted_peak_bytes for r in rows if r.predicted_peak_bytes), default=None)
        raise BudgetError(
            f"no micro-batch size fits the budget of {budget_bytes} bytes with any plan "
            f"(sizes {sorted(fakes)}); the least peak is {least} bytes",
            least_peak_bytes=least,
        )
    state = step1.state_bytes
    measured = run_candidates(model, make_loss, picked, budget_bytes, state, opt_seconds, samples,
                              rounds, since=since)  # fmt: skip
    if not any(m.measured_samples_per_s for m in measured) and any(
        _tensors_fit(m, budget_bytes) for m in measured
    ):
        # Over only with what malloc holds beside the tensors: a budget at the tensors'
        # edge, held at the allocator as a GPU counts it, and said.
        warn_tensors_only(budget_bytes, None, stacklevel=3)
        measured = run_candidates(model, make_loss, picked, budget_bytes, state, opt_seconds,
                                  samples, rounds, count_beside=False)  # fmt: skip
    for m in measured:
        rate = (
            f"{m.measured_samples_per_s:.2f} samples/s" if m.measured_samples_per_s else m.verdict
        )
        say(f"ran micro-batch {m.micro_batch} x {m.accumulation_steps} {m.strategy}: {rate}")
    measuring = time.perf_counter() - started - planning
    best = _fastest(measured)
    final = [_verdict(r, measured, best) for r in rows]
    plan: Plan = annotated(replace(best.plan, budget_bytes=budget_bytes), device)  # type: ignore[arg-type]
    return TuneResult(best.micro_batch, best.accumulation_steps, best.strategy, plan,
                      budget_bytes, tuple(final), planning, measuring, times.method)  # fmt: skip


def _tensors_fit(m: TuneCandidate, budget: int) -> bool:
    """Its tensors fit: measured so, or not run only for what malloc held beside them."""
    peak = m.measured_peak_bytes if m.measured_peak_bytes is not None else m.predicted_peak_bytes
    return peak is not None and peak <= budget


def _said(r: TuneCandidate) -> str:
    if r.predicted_samples_per_s is None:
        return f"{r.strategy} over budget"
    return f"{r.strategy} {r.predicted_samples_per_s:.2f} samples/s predicted"


def _fake_profiles(model, make_loss, sizes, step_for, budget, blocks) -> dict[int, Profile]:
    """Fake profiles at the candidate sizes (powers of two while the leanest plan fits).

    Their ops are not run for real as ``fit``'s are: at sizes no step will train at,
    the runs made libraries keep one-time buffers (a first batch-1 convolution took
    10 MiB on a 19.5 MiB budget); the candidates' checks see what the kernels take.
    """
    from gradckpt.planning.planner import Planner

    if sizes is not None:
        return {b: fake_profile(model, make_loss, b, blocks) for b in sizes}
    out: dict[int, Profile] = {}
    b = 1
    while b <= LARGEST_MICRO_BATCH:
        out[b] = fake_profile(model, make_loss, b, blocks)
        whole = with_training_step(out[b], step_for(b))
        if Planner(whole).least_peak()[1].peak_bytes > budget:
            break
        b *= 2
    return out


#: What a real profile takes at malloc's level above the fake plain step's peak: its
#: records and passes, and a new size's kernel caches (oneDNN keeps ~0.7 MiB per size
#: of a ResNet): 1.19x measured on a first profile at a size, 1.12x after.
REAL_PROFILE_MARGIN = 0.25


def _real_times(model, make_loss, fakes, held, budget, blocks, since) -> BatchTimes:
    """Real profiles at the (up to) two smallest sizes whose plain step fits the budget."""
    # A real profile runs one plain micro-batch's forward and backward (no optimizer
    # state yet, beside what already exists, and what tuning holds so far): that must fit.
    now = malloc_in_use()
    tuning = max(0, now - since) if now is not None and since is not None else 0

    def profiled(b: int) -> float:
        return (fakes[b].measured_peak_bytes + held) * (1 + REAL_PROFILE_MARGIN) + tuning

    fits = [b for b in sorted(fakes) if profiled(b) <= budget]
    # Not micro-batch 1 where a larger size fits: a batch of one takes other kernels
    # (torch convolves a small single image by im2col and MKL's sgemm, whose pool then
    # keeps ~13 MiB), so its times extrapolate worst and its run can hold the most.
    above_one = [b for b in fits if b > 1]
    fits = above_one[:2] or fits[:1]
    # Only their op times are used (memory comes from the fake profiles): no malloc probe,
    # whose held chunks and replays took tune's run to 1.05x its budget.
    with suspended():
        real = {b: profile_step(model, make_loss(b), blocks=blocks, repeats=2) for b in fits}
    return BatchTimes.fit(real, {b: fakes[b] for b in fits})


def _to_measure(rows: list[TuneCandidate], top: int) -> list[TuneCandidate]:
    """The fastest predicted gradckpt candidates, the largest plain and per-layer ones."""
    fitting = [r for r in rows if r.plan is not None]
    if any(r.micro_batch > 1 for r in fitting):
        # A batch of one takes other kernels whose library memory no profile predicts:
        # torch convolves a small single image by im2col and MKL's sgemm, whose pool took
        # ~13 MiB of an 11.7 MiB budget (ResNet, 2026-12-05). It runs only if nothing
        # larger fits.
        fitting = [r for r in fitting if r.micro_batch > 1]
    ours = sorted((r for r in fitting if r.strategy == "gradckpt"),
                  key=lambda r: -(r.predicted_samples_per_s or 0))[:top]  # fmt: skip
    picked = list(ours)
    for strategy in ("none", "per-layer"):
        largest = max((r for r in fitting if r.strategy == strategy),
                      key=lambda r: r.micro_batch, default=None)  # fmt: skip
        if largest is not None and all(_key(largest) != _key(p) for p in picked):
            picked.append(largest)
    return picked


def _key(r: TuneCandidate) -> tuple:
    return (r.micro_batch, r.plan.items if r.plan is not None else None)


def _fastest(measured: list[TuneCandidate]) -> TuneCandidate:
    """The fastest measured within the budget; the predicted fastest unless clearly beaten."""
    ran = [r for r in measured if r.measured_samples_per_s]
    if not ran:
        why = "; ".join(sorted({r.verdict for r in measured if r.verdict}))
        raise BudgetError(
            f"no candidate ran within the budget ({why}): what tuning and the steps hold "
            "beside the tensors counts too; raise the budget", least_peak_bytes=None,
        )  # fmt: skip
    rounds = min(len(r.measured_rounds) for r in ran)
    first = ran[0].measured_samples_per_s or 1.0
    # Seconds per sample relative to the predicted fastest's median, round by round.
    ratios = [[first / rate for rate in r.measured_rounds[:rounds]] for r in ran]
    return ran[pick_fastest(ratios)]


def _verdict(
    row: TuneCandidate, measured: list[TuneCandidate], best: TuneCandidate
) -> TuneCandidate:
    for m in measured:
        if _key(m) == _key(row) and m.strategy == row.strategy:
            if m is best:
                return replace(m, verdict="chosen")
            return replace(m, verdict=m.verdict or "slower (measured)")
    for m in measured:  # the same plan at the same size, measured under another strategy
        if _key(m) == _key(row):
            same = f"same plan as {m.strategy}" + (", chosen" if m is best else "")
            numbers = {f: getattr(m, f) for f in ("measured_samples_per_s", "measured_rounds",
                                                  "measured_peak_bytes")}  # fmt: skip
            return replace(row, verdict=same, **numbers)
    if row.plan is None:
        return row
    if row.micro_batch == 1 and any(m.micro_batch > 1 for m in measured):
        return replace(row, verdict="not measured (a batch of one: larger sizes fit)")
    return replace(row, verdict="not measured (predicted slower)")
