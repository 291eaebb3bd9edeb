"""Run the ``gradckpt`` command in a subprocess, on one thread (the test machine is shared)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gradckpt_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``python -m gradckpt ARGS`` with this checkout importable; stdout and stderr captured."""
    base = {k: v for k, v in os.environ.items() if k != "GRADCKPT_HIDE_EXTRAS"}
    full_env = {**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gradckpt", *args], cwd=cwd or ROOT, env=full_env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, exactly one line on stderr (no traceback), containing each fragment."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith("gradckpt: error: ")
    assert "Traceback" not in proc.stdout
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]
