"""What the commands share: budgets from the command line, profiling, plan and frontier tables."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradckpt.cli.extras import CliError, optional
from gradckpt.cli.output import Out
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.explaining.explain import Explanation

if TYPE_CHECKING:
    from gradckpt.cli.targets import Target
    from gradckpt.measure.device import DeviceMemory
    from gradckpt.planning.planner import FrontierPoint, Planner
    from gradckpt.planning.plans.plan import Plan
    from gradckpt.profiling.records import Profile

__all__ = [
    "OPTIMIZERS",
    "budget_arg",
    "check_writable",
    "cli_words",
    "describe_plan",
    "device_budget",
    "frontier_rows",
    "least_peak",
    "ms",
    "pct",
    "plan_for",
    "plan_units_table",
    "profile_target",
    "training_step",
    "write_frontier_png",
]

#: ``--optimizer`` choices: "none" (not counted) and the names
#: :func:`gradckpt.measure.optimizer_memory` knows (torch's defaults).
OPTIMIZERS = ("none", "sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor")


def budget_arg(text: str) -> int | float | str:
    """A --budget value: '0.5' and '50%' are fractions, '800MB' has units, '123' is bytes,
    'auto' (alias 'device') the device's memory less headroom, resolved by :func:`device_budget`.

    Read by the library's one budget parser (:func:`gradckpt.planning.solving.budget.read_budget`);
    the command line adds 'least' (the least feasible peak).

    Example:
        >>> budget_arg("50%"), budget_arg("0.25"), budget_arg("1.5GiB"), budget_arg("4096")
        (0.5, 0.25, '1.5GiB', 4096)
        >>> budget_arg("Device")
        'auto'
    """
    from gradckpt.planning.solving.budget import read_budget

    raw = text.strip()
    if raw.lower() == "least":
        return "least"
    try:
        kind, value = read_budget(raw)
    except ValueError as e:
        raise CliError(f"{e} On the command line, 'least' is the least feasible peak.") from None
    if kind == "fraction":
        return value
    if kind == "device":
        return "auto"
    return int(raw) if raw.isdigit() else raw


def check_writable(path: str | Path, flag: str, *, folder: bool = False) -> None:
    """Refuse (CliError) an output path that cannot be written, before any work is done.

    Example:
        >>> check_writable("plan.json", "--out")
    """
    try:
        _check_writable(Path(path), flag, folder)
    except OSError as e:  # a name too long, /proc, a read-only file system
        raise CliError(
            f"{flag} {str(path)!r} cannot be written: {e.strerror or type(e).__name__}"
        ) from e


def _check_writable(target: Path, flag: str, folder: bool) -> None:
    path = str(target)
    if not folder and target.is_dir():
        raise CliError(f"{flag} {path!r} is a directory; give a file name in it, such as "
                       f"{str(target / 'plan.json')!r}")  # fmt: skip
    if folder and target.exists() and not target.is_dir():
        raise CliError(f"{flag} {path!r} is a file, not a folder")
    existing = target if folder and target.is_dir() else target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CliError(f"{flag} {path!r} cannot be written: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK):
        raise CliError(f"{flag} {path!r} cannot be written: no permission in {str(existing)!r}")
    _try_writing(target, existing, folder)


def _try_writing(target: Path, existing: Path, folder: bool) -> None:
    """Create (and remove) a file where ``target`` will be written, or open it to append:
    ``os.access`` says yes to root on any folder, and to paths in /proc or /sys."""
    if not folder and target.parent == existing:
        if target.exists():
            with open(target, "ab"):  # nothing written: the file stays as it was
                return
        with open(target, "xb"):
            pass
        target.unlink()
        return
    with tempfile.TemporaryFile(dir=existing):  # the folders below it are made later
        pass


def budget_at_least(nbytes: int) -> str:
    """A --budget string for at least ``nbytes`` (rounded up), e.g. '3.92 MiB'.

    Example:
        >>> budget_at_least(4108808)
        '3.92 MiB'
    """
    return format_bytes(nbytes, round_up=True)


def pct(x: float) -> str:
    return f"{x:+.1%}"


def ms(seconds: float) -> str:
    """Seconds as '12.34 ms' (or '3.21 s' from 10 s on)."""
    return f"{seconds:.2f} s" if seconds >= 10 else f"{seconds * 1e3:.2f} ms"


# --------------------------------------------------------------------------- profiling, planning


def profile_target(
    target: Target, out: Out, *, fake: bool, device: str | None, blocks: Sequence[str] | None,
    repeats: int = 3,
) -> Profile:  # fmt: skip
    """Profile the target's step, with a spinner; bad block names become a CliError."""
    from gradckpt.profiling.run import ProfileError, profile

    what = "estimating (--fake: nothing allocated)" if fake else "measuring"
    with out.status(f"{what} one training step of {target.name} ..."):
        try:
            return profile(
                target.model, target.loss_fn, blocks=list(blocks) if blocks else None,
                repeats=repeats, fake=fake, device=device if fake else None,
            )  # fmt: skip
        except (ProfileError, ValueError, TypeError) as e:
            raise CliError(f"profiling {target.name} failed: {e}") from e
        except Exception as e:  # the target's own loss_fn failed
            raise CliError(
                f"profiling {target.name} failed: its loss_fn raised {type(e).__name__}: {e}"
            ) from e


def least_peak(planner: Planner) -> int:
    """The least peak gradckpt reaches for the planner's step (predicted bytes)."""
    return planner.least_peak()[1].peak_bytes


def offload_from_args(args: Any) -> Any:
    """``--offload [GB/S]`` and ``--host-budget`` as OffloadOptions (None without --offload)."""
    from gradckpt.planning.plans.offload_options import OffloadOptions
    from gradckpt.planning.solving.budget import parse_budget

    gbps = getattr(args, "offload", None)
    host = getattr(args, "host_budget", None)
    if gbps is None:
        if host is not None:
            raise CliError("--host-budget needs --offload")
        return None
    if not gbps > 0:
        raise CliError(f"--offload takes a positive link speed in GB/s, got {gbps}")
    if host is not None and (isinstance(host, float) or host == "least"):
        raise CliError("--host-budget takes bytes with units (e.g. 8GiB), not a fraction")
    try:
        budget = parse_budget(host, 0) if host is not None else None
        return OffloadOptions(d2h_bandwidth=gbps * 1e9, h2d_bandwidth=gbps * 1e9, host_budget=budget)
    except ValueError as e:
        raise CliError(str(e)) from e


def plan_for(
    planner: Planner, budget: int | float | str, solver: str, name: str, offload: Any = None
) -> Plan:
    """Solve for ``budget``; a budget below the least feasible peak becomes a CliError."""
    from gradckpt.planning.solving.budget import BudgetError
    from gradckpt.planning.solving.whole_step import check_floor

    prof = planner.profile
    nbytes = least_peak(planner) if budget == "least" else planner.budget_bytes(budget)
    if offload is not None and solver != "dp":
        raise CliError("--offload works with --solver dp (the baselines only recompute)")
    try:  # what no plan lowers (parameters, optimizer state, its step), in its own words
        check_floor(prof, nbytes)
    except BudgetError as e:
        raise CliError(f"{name}: {e}") from e
    try:
        return planner.plan(nbytes, solver, offload=offload)
    except BudgetError as e:
        least = e.least_peak_bytes if solver == "dp" else least_peak(planner)
        raise CliError(
            f"budget {format_bytes(nbytes)} is below the least feasible peak for {name}: "
            f"{format_bytes(least or 0)} ({least} bytes) with solver {solver!r} "
            f"(plain peak {format_bytes(prof.measured_peak_bytes)}); use --budget "
            f"{budget_at_least(least or 0)} or more, or shrink the batch"
        ) from e
    except ValueError as e:
        raise CliError(str(e)) from e


# --------------------------------------------------------------------------- the training step


def training_step(target: Target, args: Any, *, always: bool = False) -> Any:
    """``--optimizer``, ``--accumulation``, ``--zero-grads`` as a TrainingStep.

    None when nothing beyond one micro-batch is counted (unless ``always``: the
    breakdown then still shows, saying the optimizer is not counted). The
    optimizer's memory is predicted on fake tensors on ``--device``.
    """
    from gradckpt.measure.optimizer import OptimizerMemoryError, optimizer_memory
    from gradckpt.profiling.training_step import TrainingStep

    name = getattr(args, "optimizer", "none")
    k, to_none = getattr(args, "accumulation", 1), not getattr(args, "zero_grads", False)
    if name == "none" and k == 1 and to_none and not always:
        return None
    memory = None
    if name != "none":
        try:
            memory = optimizer_memory(target.model, name, device=args.device)
        except OptimizerMemoryError as e:
            text = str(e).replace("pass optimizer=None to plan", "use --optimizer none to plan")
            raise CliError(f"--optimizer {name}: {text}") from e
    return TrainingStep(memory, k, to_none)


def cli_words(line: str) -> str:
    """A library line about ``optimizer=`` in the command line's words."""
    return line.replace("pass optimizer=", "pass --optimizer NAME")


def device_budget(target: Target, device: str) -> DeviceMemory:
    """``--budget auto``: the memory of ``device`` less headroom (a CliError where unknown).

    Counted as held (on CPU): the target's real parameters and buffers on that
    device (built-ins under --fake are on meta and hold nothing).
    """
    import torch

    from gradckpt.measure.device import device_memory

    try:
        where = torch.device(device)
        seen: dict[int, int] = {}
        for t in [*target.model.parameters(), *target.model.buffers()]:
            if t.device == where and not t.is_meta:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return device_memory(where, held_bytes=sum(seen.values()))
    except (ValueError, RuntimeError) as e:
        raise CliError(f"--budget auto: {e}") from e


def describe_plan(plan: Plan) -> str:
    """'2 recompute, 4 selective, 1 segment' (units not kept plainly)."""
    from gradckpt.engine.decisions import decision_kinds
    from gradckpt.planning.plans.plan import Segment, iter_units

    units = list(iter_units(plan.items))
    kinds = [k for k in decision_kinds() if k != "keep"]  # registration order
    counts = {m: sum(u.mode == m for u in units) for m in kinds}
    parts = [f"{n} {m}" for m, n in counts.items() if n]
    segments = sum(isinstance(i, Segment) for i in plan.items)
    if segments:
        parts.append(f"{segments} segment{'s' * (segments > 1)}")
    if plan.token_chunks:
        parts.append(f"{len(plan.token_chunks)} MLP chunk{'s' * (len(plan.token_chunks) > 1)}")
    return ", ".join(parts) or "all kept (no checkpointing)"


def chunk_lines(plan: Plan) -> list[str]:
    """One line per unit the plan chunks: what runs in slices, and what that costs."""
    from gradckpt.engine.decisions import Chunk

    lines = [
        f"{u.path} and the loss after it run in {u.decision.chunks} slices of tokens (logits "
        "never whole; recomputed once in backward; exact up to the order of sums)"
        for u in plan.units
        if isinstance(u.decision, Chunk)
    ]
    if plan.token_chunks:
        ks = "/".join(str(k) for k in sorted({k for _, k in plan.token_chunks}))
        first, last = plan.token_chunks[0][0], plan.token_chunks[-1][0]
        which = first if first == last else f"{first} .. {last}"
        lines.append(
            f"{len(plan.token_chunks)} token-wise MLPs ({which}) run in {ks} slices of tokens "
            "(their hidden never whole; recomputed once in backward; exact up to the order of sums)"
        )
    return lines


def plan_units_table(out: Out, explanation: Explanation, title: str | None = None) -> None:
    """Per unit: the plan's decision, bytes kept and recomputed, recompute time."""
    rows = []
    for u in explanation.units:
        name = f"{u.path} (block)" if u.is_block else u.path
        rows.append([
            name, u.decision, format_bytes(u.kept_bytes) if u.kept_bytes else "-",
            format_bytes(u.recomputed_bytes) if u.recomputed_bytes else "-",
            ms(u.recompute_time) if u.recompute_time else "-",
        ])  # fmt: skip
    recompute = sum(u.recompute_time for u in explanation.units)
    footer = [
        "total", "", format_bytes(explanation.kept_bytes),
        format_bytes(explanation.recomputed_bytes) if explanation.recomputed_bytes else "-",
        ms(recompute) if recompute else "-",
    ]  # fmt: skip
    out.table(
        ["unit", "decision", "kept for backward", "recomputed", "recompute time"], rows,
        title=title, right=(2, 3, 4), footer=footer,
    )  # fmt: skip


# --------------------------------------------------------------------------- the frontier


def frontier_rows(points: Sequence[FrontierPoint], plain_peak: int, limit: int = 10) -> list:
    """At most ``limit`` frontier points, evenly spread, as table rows."""
    if len(points) > limit:
        step = (len(points) - 1) / (limit - 1)
        points = [points[round(i * step)] for i in range(limit)]
    return [
        [format_bytes(p.peak_bytes), f"{p.peak_bytes / plain_peak:.0%}", pct(p.overhead),
         describe_plan(p.plan)]
        for p in points
    ]  # fmt: skip


def write_frontier_png(
    path: Path,
    points: Sequence[FrontierPoint],
    *,
    title: str,
    plain_peak: int,
    budget: int | None = None,
    marks: Sequence[tuple[str, int, float, str]] = (),
) -> bool:
    """Plot the frontier (peak MiB vs predicted overhead) with labelled points; False if no
    matplotlib. ``marks``: (label, peak bytes, overhead, marker)."""
    matplotlib = optional("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1 << 20
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p.peak_bytes / mib for p in points]
    ys = [100 * p.overhead for p in points]
    ax.step(xs, ys, where="post", color="0.25", label="gradckpt frontier (predicted)")
    ax.plot(xs, ys, ".", color="0.25")
    if budget is not None:
        ax.axvline(budget / mib, color="tab:orange", ls="--", lw=1, label="budget")
    ax.axvline(plain_peak / mib, color="0.7", ls=":", lw=1, label="plain peak")
    for label, peak, overhead, marker in marks:
        ax.plot(peak / mib, 100 * overhead, marker, ms=9, label=label, zorder=5)
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("step-time overhead (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def target_header(out: Out, target: Target, prof: Profile, *, fake: bool) -> None:
    """Target, size, device and the plain step's numbers."""
    mode = "estimated with --fake (nothing allocated)" if fake else "measured"
    out.heading(f"{target.name}: {target.description}")
    out.print(
        f"  {target.params / 1e6:.1f}M parameters ({format_bytes(prof.param_bytes)} with buffers), "
        f"{len(prof.blocks)} blocks, {len(prof.units)} units; device {prof.device}; step {mode}"
    )
    out.print(
        f"  plain step: peak {format_bytes(prof.measured_peak_bytes)}, "
        f"{ms(prof.step_time)}{' (estimate)' if fake else ''}"
    )


def jsonable_profile(prof: Profile) -> dict[str, Any]:
    return {
        "fake": prof.fake, "device": prof.device, "param_bytes": prof.param_bytes,
        "plain_peak_bytes": prof.measured_peak_bytes, "step_time_s": prof.step_time,
        "blocks": [u.path for u in prof.blocks], "units": [u.path for u in prof.units],
    }  # fmt: skip
