"""Smoke tests: each benchmark script runs in --quick mode and writes its report.

They check that the scripts work and write the expected tables; they never
assert on the measured numbers (those belong in the results files).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATE = datetime.date.today().isoformat()


def _run(module: str, out: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        # One thread: on a shared 2-core machine two OpenMP threads of a tiny model
        # spin against other processes and the smoke test slows down threefold.
        [sys.executable, "-m", module, "--quick", "--threads", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _written(out: Path, what: str) -> tuple[str, dict]:
    md = sorted(out.glob(f"{what}-cpu-*.md"))  # dated when written: may cross midnight
    assert len(md) == 1, f"expected one {what} report in {out}, found {md}"
    assert md[0].name in {f"{what}-cpu-{DATE}.md", f"{what}-cpu-{datetime.date.today()}.md"}
    data = json.loads(md[0].with_suffix(".json").read_text())
    return md[0].read_text(), data


def test_engine_quick_writes_report(tmp_path: Path) -> None:
    proc = _run("benchmarks.engine", tmp_path)
    text, data = _written(tmp_path, "engine")
    header = "| contender | what | median step (s) | time / plain | fastest / plain's fastest |"
    assert header in text
    assert "| target | wanted | measured (medians) | fastest runs | verdict (medians) |" in text
    for name in ("plain", "torch_full", "gradckpt_full", "gradckpt_save_all",
                 "gradckpt_save_matmuls", "torch_sac_matmuls"):  # fmt: skip
        assert f"`{name}`" in text
        assert data["results"][name]["peak_bytes"] > 0
    assert data["info"]["quick"] is True
    assert "cpu" in data["info"] and "torch" in data["info"]
    assert "time / plain" in proc.stdout  # the table is printed too
    # --from-json re-renders the same report without measuring
    again = tmp_path / "again"
    saved = next(tmp_path.glob("engine-cpu-*.json"))
    rerun = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--from-json", str(saved), "--out", str(again)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _written(again, "engine")[0] == text


def test_frontier_quick_writes_report_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    proc = _run("benchmarks.frontier", tmp_path)
    text, data = _written(tmp_path, "frontier")
    assert "| budget | budget (MiB) | gradckpt plan |" in text
    assert "| contender | least | every_block | 25% | 50% | 75% | plain |" in text
    assert "| target | wanted | measured | verdict |" in text
    assert "## Planning time (profile excluded)" in text
    assert [m["model"] for m in data["models"]] == ["gpt", "gpt_act", "unet", "resnet_conv"]
    assert "| target | wanted | measured | verdict |" in text and "allocator peak" in text
    for model in data["models"]:
        assert [b["label"] for b in model["budgets"]] == [
            "least",
            "every_block",
            "25%",
            "50%",
            "75%",
            "plain",
        ]
    pngs = list(tmp_path.glob("frontier-cpu-*.png"))
    assert len(pngs) == 1 and pngs[0].stat().st_size > 0
    assert "wrote" in proc.stdout


def test_allocator_accuracy_quick_writes_report(tmp_path: Path) -> None:
    _run("benchmarks.allocator_accuracy", tmp_path)
    text, data = _written(tmp_path, "allocator-accuracy")
    assert "| target | wanted | measured | verdict |" in text
    assert [m["model"] for m in data["models"]] == ["mlp", "unet"]
    for model in data["models"]:
        plans = [r["plan"] for r in model["rows"]]
        assert plans[0] == "none" and "dp@least" in plans
        assert all(r["allocator"] >= r["tracker"] > 0 for r in model["rows"])


def test_compile_quick_writes_report(tmp_path: Path) -> None:
    proc = _run("benchmarks.compile", tmp_path)
    text, data = _written(tmp_path, "compile")
    assert "| contender | what | median step (s) | time / plain | time / planned |" in text
    contenders = ["plain", "planned", "planned_compiled", "plain_compiled"]
    assert list(data["results"]) == contenders
    # Peaks only for the eager contenders (the tracker runs compiled code eagerly).
    assert [data["results"][n]["peak_bytes"] is not None for n in contenders] == [
        True, True, False, False,
    ]  # fmt: skip
    info = data["info"]
    assert info["backend"] == "aot_eager" and info["quick"] is True
    assert {"load_average_before", "load_average_after", "wall_time_s"} <= set(info)
    assert "wrote" in proc.stdout


def test_compiled_cache_probe_quick_writes_report(tmp_path: Path) -> None:
    _run("benchmarks.compiled_cache_probe", tmp_path)
    text, data = _written(tmp_path, "compiled-cache-probe")
    assert "| trial | scratch / cached1 | cached2 / cached1 |" in text
    (trial,) = data["trials"]
    assert set(trial["times"]) == {"scratch", "cached1", "cached2"}
    assert all(len(t) == 2 for t in trial["times"].values())  # --quick: 2 timed rounds
    assert trial["scratch_over_cached"] > 0 and trial["cached_over_cached"] > 0


def test_wild_blocks_quick_writes_report(tmp_path: Path) -> None:
    _run("benchmarks.wild_blocks", tmp_path)
    text, data = _written(tmp_path, "wild-blocks-titan-llama")
    for name in ("plain", "torch_full", "torch_sac", "gradckpt_full_peak", "gradckpt_sac_peak"):
        assert f"`{name}`" in text
        assert data["results"][name]["peak_bytes"] > 0
    assert "| target | wanted | measured | verdict |" in text
    assert data["extra"]["blocks_found"] == ["layers.0", "layers.1"]


def test_engine_short_ops_quick_writes_report(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--short-ops", "--quick", "--threads", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text, data = _written(tmp_path, "engine-shortops")
    for name in ("plain", "torch_full", "torch_sac", "gradckpt_full", "gradckpt_selective",
                 "fit_least", "fit_midway", "fit_plain"):  # fmt: skip
        assert f"`{name}`" in text
        assert data["configs"]["short"]["results"][name]["peak_bytes"] > 0
    assert "| target | wanted | measured [95% CI] | verdict |" in text
    assert "| contender | plan | predicted | measured | error | verdict |" in text
    # fit at the plain peak recomputes nothing; at its least peak it does.
    plans = data["configs"]["short"]["plans"]
    assert set(plans["fit_plain"]["units"].values()) == {"keep"}
    least = plans["fit_least"]
    assert set(least["units"].values()) != {"keep"} or least.get("token_chunks")
    again = tmp_path / "again"
    saved = next(tmp_path.glob("engine-shortops-cpu-*.json"))
    rerun = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--short-ops", "--from-json", str(saved),
         "--out", str(again)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _written(again, "engine-shortops")[0] == text


def test_shortops_pooled_pools_every_round_of_the_runs(tmp_path: Path) -> None:
    from benchmarks.harness.stats import median_interval, paired_ratios
    from benchmarks.shortops_pooled import main

    runs = [ROOT / f"benchmarks/results/engine-shortops-cpu-2026-12-05-{s}.json" for s in "gh"]
    assert main([str(p) for p in runs] + ["--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("engine-shortops-pooled-cpu-*.json")
    pooled = json.loads(written.read_text())["configs"]["short"]
    row = pooled["fit at the plain peak / the same model plain (toggled)"]
    ratios = []
    for path in runs:
        toggled = json.loads(path.read_text())["configs"]["short"]["toggled_fit_plain"]
        ratios += paired_ratios({"times": toggled["fit_plain"]}, {"times": toggled["plain"]})
    assert row["rounds"] == len(ratios) == 160
    assert row["pooled"] == list(median_interval(ratios))
    assert set(row["per_run"]) == {p.stem for p in runs}
