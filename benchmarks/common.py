"""Shared helpers for the benchmark scripts: contenders, steps, measurement, reports.

Every benchmark follows one discipline:

* each contender runs on its own copy of the model, built from the zoo with the
  same seed (identical weights and batch), so installing one contender never
  disturbs another and nothing is installed or removed inside a timed step;
* a step is ``grads = None; torch.manual_seed(seed); loss_fn().backward()``;
* the peak of each contender is measured in a separate, untimed step at two
  levels: the allocator's (:class:`gradckpt.measure.AllocatorTracker`: every
  byte the allocator handed out, kernel workspaces included, + params/buffers;
  ``peak_bytes``, what budgets are checked against) and the tensors'
  (:class:`gradckpt.measure.MemoryTracker`: live created storage +
  params/buffers; ``tracker_peak_bytes``);
* times come from :func:`gradckpt.measure.time_interleaved` (A B C A B C ...,
  median after warm-up), reported as ratios over the plain contender.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_ckpt
from torch import nn

import gradckpt
from gradckpt.measure import (
    AllocatorTracker,
    MemoryTracker,
    Timing,
    ratio,
    state_bytes,
    time_interleaved,
)
from gradckpt.testing import Example

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"

Undo = Callable[[], None]
Installer = Callable[[Example], Undo]  # install a contender on an example's model; returns undo


# --------------------------------------------------------------------------- contenders


def wrap_blocks(
    model: nn.Module, paths: Iterable[str], wrap: Callable[[Callable], Callable]
) -> Undo:
    """Replace each block's ``forward`` (instance attribute) by ``wrap(forward)``; returns undo."""
    modules = dict(model.named_modules())
    done: list[tuple[nn.Module, bool, Any]] = []
    for path in paths:
        module = modules[path]
        had_own = "forward" in module.__dict__
        done.append((module, had_own, module.__dict__.get("forward")))
        module.forward = wrap(module.forward)

    def undo() -> None:
        for module, had_own, previous in reversed(done):
            if had_own:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)

    return undo


def torch_checkpoint(forward: Callable) -> Callable:
    """``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return torch_ckpt.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def torch_sac(ops: Iterable[Any]) -> Callable[[Callable], Callable]:
    """torch selective activation checkpointing that saves the outputs of ``ops``."""
    context_fn = functools.partial(torch_ckpt.create_selective_checkpoint_contexts, list(ops))

    def wrap(forward: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            return torch_ckpt.checkpoint(
                forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs
            )

        return run

    return wrap


def gradckpt_checkpoint(policy: Any = None) -> Callable[[Callable], Callable]:
    """``gradckpt.checkpoint(forward, ..., policy=policy)``."""

    def wrap(forward: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            return gradckpt.checkpoint(forward, *args, policy=policy, **kwargs)

        return run

    return wrap


def plain() -> Installer:
    """The uncheckpointed model."""
    return lambda example: lambda: None


def per_block(
    wrap: Callable[[Callable], Callable], paths: Sequence[str] | None = None
) -> Installer:
    """Wrap every block (``paths``, default the zoo's ``block_paths``) with ``wrap``."""
    return lambda example: wrap_blocks(
        example.model, paths if paths is not None else example.block_paths, wrap
    )


def with_plan(plan: gradckpt.Plan) -> Installer:
    """``gradckpt.apply(model, plan)``; undone by ``gradckpt.remove``."""

    def install(example: Example) -> Undo:
        gradckpt.apply(example.model, plan)
        return lambda: gradckpt.remove(example.model)

    return install


# --------------------------------------------------------------------------- steps


def make_step(example: Example, seed: int = 0) -> Callable[[], torch.Tensor]:
    """One training step: drop old grads, seed the RNG, forward + backward; returns the loss."""
    params = list(example.model.parameters())

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        torch.manual_seed(seed)
        loss = example.loss_fn()
        loss.backward()
        return loss.detach()

    return step


def measure_peaks(example: Example, install: Installer, seed: int = 0) -> tuple[int, int, float]:
    """Allocator peak, tensor (tracker) peak and loss of one untimed step with ``install``.

    Both peaks include the model's parameters and buffers. The allocator is
    read on the device the model lives on (CPU: torch's profiler memory events;
    CUDA: the caching allocator's statistics).
    """
    undo = install(example)
    try:
        step = make_step(example, seed)
        device = next(example.model.parameters()).device
        with AllocatorTracker(device) as allocator, MemoryTracker(example.model) as tracker:
            loss = step()
        for p in example.model.parameters():
            p.grad = None
        peak = state_bytes(example.model) + allocator.peak_bytes
        return peak, tracker.peak_bytes, float(loss)
    finally:
        undo()


def measure_peak(example: Example, install: Installer, seed: int = 0) -> tuple[int, float]:
    """The allocator's peak bytes (params included) and loss of one untimed step."""
    peak, _, loss = measure_peaks(example, install, seed)
    return peak, loss


def measured_from_json(rows: dict[str, dict[str, Any]], baseline: str) -> dict[str, Measured]:
    """Rebuild :class:`Measured` results (ratios recomputed) from ``Measured.to_json`` rows."""
    out = {}
    for name, row in rows.items():
        times = row.get("times_s")
        m = Measured(name, row["peak_bytes"], row["loss"], row.get("tracker_peak_bytes"))
        if times:
            m.timing = Timing.from_times(times)
        out[name] = m
    base = out[baseline].timing
    for m in out.values():
        if m.timing is not None and base is not None:
            m.ratio = ratio(m.timing, base)
            m.min_ratio = min(m.timing.times) / min(base.times)
    return out


@dataclass
class Measured:
    """One contender's measured peak and step times."""

    name: str
    peak_bytes: int  # the allocator's (budgets are checked against it)
    loss: float
    tracker_peak_bytes: int | None = None  # the tensors' (MemoryTracker)
    timing: Timing | None = None
    ratio: float | None = None  # median step time over the baseline's
    min_ratio: float | None = None  # fastest run over the baseline's fastest (least disturbed)
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peak_bytes": self.peak_bytes,
            "peak_mib": self.peak_bytes / MiB,
            "tracker_peak_bytes": self.tracker_peak_bytes,
            "loss": self.loss,
            "median_s": self.timing.median if self.timing else None,
            "times_s": list(self.timing.times) if self.timing else None,
            "ratio": self.ratio,
            "min_ratio": self.min_ratio,
            **self.info,
        }


def measure_contenders(
    build: Callable[[], Example],
    contenders: dict[str, Installer],
    *,
    baseline: str,
    warmup: int,
    repeats: int,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Measured]:
    """Measure every contender's peak (untimed step), then time them all interleaved.

    Each contender gets its own model from ``build()`` (same seed, same weights),
    installed once before timing and removed after.
    """
    if baseline not in contenders:
        raise ValueError(f"the baseline {baseline!r} is not among the contenders")
    examples: dict[str, Example] = {}
    undos: list[Undo] = []
    try:
        results: dict[str, Measured] = {}
        steps: dict[str, Callable[[], torch.Tensor]] = {}
        for name, install in contenders.items():
            example = build()
            examples[name] = example
            peak, tracker_peak, loss = measure_peaks(example, install, seed)
            results[name] = Measured(name, peak, loss, tracker_peak)
            undos.append(install(example))
            steps[name] = make_step(example, seed)
            log(f"  peak {name:<28} {peak / MiB:10.1f} MiB (tensors {tracker_peak / MiB:.1f})"
                f"  loss {loss:.6f}")  # fmt: skip
        log(f"  timing {len(steps)} contenders interleaved: {warmup} warm-up, {repeats} rounds")
        timings = time_interleaved(steps, warmup=warmup, repeats=repeats)
        for name, timing in timings.items():
            results[name].timing = timing
            results[name].ratio = ratio(timing, timings[baseline])
            results[name].min_ratio = min(timing.times) / min(timings[baseline].times)
        return results
    finally:
        for undo in reversed(undos):
            undo()
        for example in examples.values():
            for p in example.model.parameters():
                p.grad = None


# --------------------------------------------------------------------------- reports


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (as ``uptime`` shows them)."""
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def _loads(loads: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.2f}" for x in loads)


@dataclass(frozen=True)
class RunClock:
    """When a benchmark run started and how busy the machine was then.

    Example:
        >>> clock = RunClock.start()
        >>> ...  # measure
        >>> info = machine_info(sizes=sizes, **clock.info())
    """

    load_before: tuple[float, float, float]
    started: float

    @classmethod
    def start(cls) -> RunClock:
        """The load average and the clock now."""
        return cls(load_average(), time.perf_counter())

    def info(self) -> dict[str, Any]:
        """``load_average_before``/``_after`` and ``wall_time_s`` up to now, for :func:`machine_info`.

        :func:`load_note` reads the two load averages to warn that timings were
        taken on a busy machine.
        """
        return {
            "load_average_before": _loads(self.load_before),
            "load_average_after": _loads(load_average()),
            "wall_time_s": round(time.perf_counter() - self.started, 1),
        }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# Environment variables that change a CPU step's speed: glibc's allocator, the OpenMP runtime,
# a preloaded allocator (tcmalloc, jemalloc).
SPEED_VARIABLES = ("MALLOC_", "GLIBC_TUNABLES", "OMP_", "KMP_", "GOMP_", "LD_PRELOAD")


def speed_environment() -> dict[str, str]:
    """The set environment variables that change step times (see ``SPEED_VARIABLES``)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(SPEED_VARIABLES)}


def machine_info(**extra: Any) -> dict[str, Any]:
    """What the numbers were measured on, plus ``extra`` (sizes, repeats, ...)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=here,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "status", "--porcelain", "--", "gradckpt"],
            capture_output=True, text=True, timeout=10, cwd=here.parent,
        ).stdout.strip()  # fmt: skip
        if commit and dirty:
            commit += " + uncommitted changes in gradckpt/"
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gradckpt": gradckpt.__version__,
        "git_head": commit or "unknown",
        **({"environment": env} if (env := speed_environment()) else {}),
        **extra,
    }


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells are str()-ed."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def info_block(info: dict[str, Any]) -> str:
    """Machine info and settings as a Markdown bullet list."""
    return "\n".join(f"- **{k}**: {v}" for k, v in info.items())


def mib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MiB:.1f}"


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"


def load_note(info: dict[str, Any], limit: float = 1.5) -> str:
    """A warning when the machine was busy, else ''.

    Busy: a 1-minute load above ``limit`` before the run, or after it above
    ``limit`` plus the run's own threads (``info["threads"]``; the load taken
    at the end counts the benchmark's own busy threads, which are not
    competition).
    """

    def first(value: Any) -> float:
        try:
            return float(str(value).split("/")[0])
        except ValueError:
            return float("nan")

    before = first(info.get("load_average_before"))
    after = first(info.get("load_average_after"))
    own = float(info.get("threads") or 0)
    if not (before > limit or after > limit + own):
        return ""
    return (
        f"**Shared machine:** the 1-minute load average was {before:.2f} before and "
        f"{after:.2f} after the run ({info.get('cores')} cores). Other processes competed for "
        "the CPUs during the measurement, so step times and their ratios carry that noise; "
        "peaks (and predictions) do not depend on load."
    )


def hardware_slug(gpu: str | None) -> str:
    """A results file's hardware part: ``cpu``, or the GPU's name as a slug.

    Example:
        >>> hardware_slug("NVIDIA H200")
        'nvidia-h200'
    """
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") if gpu else "cpu"


def results_path(
    out: Path, what: str, ext: str, date: str | None = None, where: str = "cpu"
) -> Path:
    """``<out>/<what>-<where>-<YYYY-MM-DD>.<ext>`` (today unless ``date`` is given)."""
    return Path(out) / f"{what}-{where}-{date or datetime.date.today().isoformat()}.{ext}"


def write_results(
    out: Path, what: str, markdown: str, data: dict[str, Any], date: str | None = None,
    where: str = "cpu",
) -> tuple[Path, Path]:  # fmt: skip
    """Write the Markdown report and its JSON next to it; returns both paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, js = (results_path(out, what, ext, date, where) for ext in ("md", "json"))
    md.write_text(markdown.rstrip() + "\n")
    js.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return md, js


def base_parser(description: str) -> argparse.ArgumentParser:
    """Flags every benchmark script shares."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, 1 warm-up round, 2 timed rounds (a smoke test, < 60 s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="directory for the Markdown/JSON (and PNG) results (default: %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads value (default: %(default)s)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="unmeasured interleaved rounds before timing (default 1)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed interleaved rounds; the median is reported (default 5, quick 2)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="re-render the report (Markdown, PNG) from a JSON an earlier run wrote; measures nothing",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="torch.manual_seed before every step (default: %(default)s)",
    )
    return p  # fmt: skip


def settle(args: argparse.Namespace) -> None:
    """Apply the shared flags: thread count and quick-mode defaults."""
    torch.set_num_threads(args.threads)
    if args.warmup is None:
        args.warmup = 1
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
