"""Results files and their Markdown: names by what/where/when, tables, cells."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parents[1] / "results"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells are str()-ed."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def info_block(info: dict[str, Any]) -> str:
    """Machine info and settings as a Markdown bullet list."""
    return "\n".join(f"- **{k}**: {v}" for k, v in info.items())


def mib(nbytes: float | None) -> str:
    """Bytes as MiB with one decimal; ``n/a`` for None."""
    return "n/a" if nbytes is None else f"{nbytes / MiB:.1f}"


def fmt_ratio(value: float | None) -> str:
    """A ratio with three decimals; ``n/a`` for None."""
    return "n/a" if value is None else f"{value:.3f}"


def fmt_interval(r: Sequence[float] | None) -> str:
    """A ratio's median and interval (``median_interval``'s triple) as percentages over 1.

    Example:
        >>> fmt_interval((1.05, 0.98, 1.12))
        '+5.0% [-2.0%, +12.0%]'
    """
    return "-" if r is None else f"{r[0] - 1:+.1%} [{r[1] - 1:+.1%}, {r[2] - 1:+.1%}]"


def verdict(met: bool) -> str:
    """A target's verdict cell."""
    return "**met**" if met else "**missed**"


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
    where: str = "cpu", overwrite: bool = False,
) -> tuple[Path, Path]:  # fmt: skip
    """Write the Markdown report and its JSON next to it; returns both paths.

    A run never replaces an earlier one's files: a second run of the day is
    ``...-<date>-b``, then ``-c`` (``overwrite``: the date's first name, as a
    re-render of that run wants).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    first = [results_path(out, what, ext, date, where) for ext in ("md", "json")]
    md, js = first
    suffixes = [""] if overwrite else ["", *(f"-{c}" for c in "bcdefghijklmnopqrstuvwxyz")]
    for suffix in suffixes:
        md, js = (path.with_stem(path.stem + suffix) for path in first)
        if overwrite or not (md.exists() or js.exists()):
            break
    else:
        raise FileExistsError(f"every run name of {what} on this date is taken in {out}")
    md.write_text(markdown.rstrip() + "\n")
    js.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return md, js


def read_results(path: Path) -> dict[str, Any]:
    """The data an earlier run wrote (``--from-json``)."""
    return json.loads(Path(path).read_text())


def rerender(
    source: Path, out: Path, what: str, report: Callable[[Any, dict[str, Any]], str]
) -> tuple[Path, Path]:
    """Write the report of an earlier run's ``{"results", "info"}`` JSON again, measuring
    nothing (``--from-json``), under the run's own date; prints the Markdown.

    Example:
        >>> rerender(Path("chunk-cpu-2026-12-04.json"), RESULTS, "chunk", report)
    """
    data = read_results(source)
    markdown = report(data["results"], data["info"])
    print(markdown)
    return write_results(out, what, markdown, data, date=data["info"]["date"], overwrite=True)
