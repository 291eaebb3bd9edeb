"""Terminal output: rich tables and progress bars on a terminal, plain text elsewhere.

Plain text is used when stdout is not a terminal (pipes, CI, tests) or rich is
not installed; ``--json`` silences everything but the JSON document.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from gradckpt.cli.extras import optional

__all__ = ["Out", "Progress"]


class Progress:
    """A progress bar (rich) or a few progress lines (plain); ``advance(info=...)``."""

    def __init__(self, out: Out, total: int, description: str) -> None:
        self.out, self.total, self.description = out, total, description
        self.done = 0
        self._bar = None
        self._task = None
        self._every = max(1, total // 5)

    def __enter__(self) -> Progress:
        if self.out.console is not None and not self.out.quiet:
            from rich import progress as rp

            self._bar = rp.Progress(
                rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(),
                rp.MofNCompleteColumn(), rp.TextColumn("{task.fields[info]}"),
                rp.TimeElapsedColumn(),
                console=self.out.console,
            )  # fmt: skip
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total, info="")
        return self

    def advance(self, info: str = "", description: str | None = None) -> None:
        self.done += 1
        if self._bar is not None:
            fields = {"description": description} if description else {}
            self._bar.update(self._task, advance=1, info=info, **fields)
        elif self.done % self._every == 0 or self.done == self.total:
            self.out.print(f"  {description or self.description} {self.done}/{self.total} {info}")

    def note(self, info: str, description: str | None = None) -> None:
        """Change the text without advancing."""
        if self._bar is not None:
            fields = {"description": description} if description else {}
            self._bar.update(self._task, info=info, **fields)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


class Out:
    """Where a command writes its human output."""

    def __init__(self, *, quiet: bool = False, fancy: bool | None = None) -> None:
        self.quiet = quiet
        if fancy is None:
            fancy = sys.stdout.isatty()
        console = optional("rich.console") if fancy else None
        self.console = console.Console(highlight=False) if console is not None else None

    # ------------------------------------------------------------------ text

    def print(self, text: str = "", style: str | None = None) -> None:
        if self.quiet:
            return
        if self.console is not None:
            self.console.print(text, style=style, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def heading(self, text: str) -> None:
        if self.console is not None:
            self.print(text, style="bold")
        else:
            self.print(text)

    def good(self, text: str) -> None:
        self.print(text, style="green")

    def bad(self, text: str) -> None:
        self.print(text, style="bold red")

    def json(self, data: Any) -> None:
        """The machine-readable result: always printed, even when quiet."""
        print(json.dumps(data, indent=1, default=str), flush=True)

    # ---------------------------------------------------------------- tables

    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        title: str | None = None,
        right: Sequence[int] = (),
        footer: Sequence[str] | None = None,
    ) -> None:
        """Rows of strings under ``columns``; column indices in ``right`` are right-aligned."""
        if self.quiet:
            return
        if self.console is not None:
            from rich.table import Table

            table = Table(title=title, title_justify="left", show_footer=footer is not None)
            for i, name in enumerate(columns):
                table.add_column(
                    name, justify="right" if i in right else "left",
                    footer=footer[i] if footer is not None else "",
                )  # fmt: skip
            for row in rows:
                table.add_row(*row)
            self.console.print(table)
            return
        for line in plain_table(columns, rows, title=title, right=right, footer=footer):
            print(line, flush=True)

    # -------------------------------------------------------------- progress

    def progress(self, total: int, description: str) -> Progress:
        return Progress(self, total, description)

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[None]:
        """A spinner while a long call runs (plain: one line before it)."""
        if self.quiet:
            yield
            return
        if self.console is not None:
            with self.console.status(text):
                yield
        else:
            self.print(text)
            yield


def plain_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    right: Sequence[int] = (),
    footer: Sequence[str] | None = None,
) -> list[str]:
    """A fixed-width text table (two spaces between columns, dashes under the header)."""
    body = [list(columns), *(list(r) for r in rows)]
    if footer is not None:
        body.append(list(footer))
    widths = [max(len(str(r[i])) for r in body) for i in range(len(columns))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    lines = [title] if title else []
    lines.append(fmt(columns))
    lines.append("  ".join("-" * w for w in widths))
    lines += [fmt(r) for r in rows]
    if footer is not None:
        lines.append("  ".join("-" * w for w in widths))
        lines.append(fmt(footer))
    return lines
