"""What a run was measured on: the machine, its load, the environment, how to rerun it."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import gradckpt

REPOSITORY = Path(__file__).resolve().parents[2]


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
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
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


def _git_head() -> str:
    """The commit measured, marked when ``gradckpt/`` had uncommitted changes; '' if unknown."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=REPOSITORY / "benchmarks",
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "status", "--porcelain", "--", "gradckpt"],
            capture_output=True, text=True, timeout=10, cwd=REPOSITORY,
        ).stdout.strip()  # fmt: skip
        if commit and dirty:
            commit += " + uncommitted changes in gradckpt/"
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return commit


def machine_info(**extra: Any) -> dict[str, Any]:
    """What the numbers were measured on, plus ``extra`` (sizes, repeats, ...)."""
    commit = _git_head()
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


def rerun_command(module: str, argv: list[str] | None) -> str:
    """The shell line that reruns ``python -m <module>`` with this run's arguments
    (``argv``; None: the process's own)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", "-m", module, *args])


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
