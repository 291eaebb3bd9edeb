"""``gradckpt bench`` runs the benchmark scripts it finds, passes --quick/--out, and goes on past
a missing one; a failing script makes the exit status 1 and shows its last lines."""

from __future__ import annotations

import textwrap

from .conftest import gradckpt_cli

SCRIPT = textwrap.dedent("""
    import argparse, pathlib, sys
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    print("working on", pathlib.Path(__file__).stem, "quick" if args.quick else "full")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / (pathlib.Path(__file__).stem + "-cpu.md")).write_text("quick=%s" % args.quick)
    sys.exit(3 if "frontier" in __file__ else 0)
""")


def test_bench_runs_scripts_and_reports(tmp_path):
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "engine.py").write_text(SCRIPT)
    (scripts / "frontier.py").write_text(SCRIPT)  # exits 3
    results = tmp_path / "results"
    proc = gradckpt_cli("bench", "--quick", "--dir", str(scripts), "--out", str(results))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (results / "engine-cpu.md").read_text() == "quick=True"
    assert "hf_models.py is missing: skipped" in proc.stdout
    assert "frontier failed (exit 3)" in proc.stdout
    assert "| working on frontier quick" in proc.stdout  # the failing script's last lines
    assert f"wrote {results / 'engine-cpu.md'}" in proc.stdout
    assert "1/2 benchmarks succeeded" in proc.stdout
