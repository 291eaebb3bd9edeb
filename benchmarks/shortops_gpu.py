"""The short-op engine rows on CUDA (``benchmarks/gpu_check.py``'s stage), eager and as CUDA graphs.

On a GPU a short-op model is bound by the host: the engine's per-op Python is
what separates the contenders (issue #42). Every row of
:mod:`benchmarks.engine_shortops` is measured on the GPU eagerly (wall time, the
device synchronized around each step), and then, where torch can capture it, as
one CUDA graph of the whole training step (forward and backward, replayed:
the host's Python runs once, at capture, so what is left is the kernels,
recompute included). A contender whose step cannot be captured (torch refuses
an op during capture, e.g. reading the CUDA RNG state to preserve it) gets the
error in its row instead of a time: that is what "where torch allows
checkpointing under CUDA graphs" is, measured rather than assumed.

In a CPU dry run the eager rows run at tiny sizes and the graph rows say why
they were skipped.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import engine_shortops as shortops
from benchmarks.harness import clear_grads
from gradckpt.testing import Example, make

__all__ = ["graph_rows", "report_lines", "run_shortops"]

_GRAPH_WARMUP, _GRAPH_REPEATS = 3, 20


def _captured_step(example: Example) -> Callable[[], None]:
    """One training step of ``example`` captured as a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as torch's docs do
        for _ in range(_GRAPH_WARMUP):
            clear_grads(example.model)
            example.loss_fn().backward()
    torch.cuda.current_stream().wait_stream(stream)
    clear_grads(example.model)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        example.loss_fn().backward()
    return graph.replay


def graph_rows(
    sizes: dict[str, Any], budgets: dict[str, float], plans: dict[str, Any], seed: int = 0
) -> dict[str, dict[str, Any]]:
    """Each contender's step as a CUDA graph: median replay seconds, or why it was not captured."""
    build = functools.partial(make, "gpt", device="cuda", seed=seed, **sizes)
    rows: dict[str, dict[str, Any]] = {}
    replays: dict[str, Callable[[], None]] = {}
    undos = []
    for name, install in shortops.contenders(budgets, plans).items():
        example = build()
        undos.append(install(example))
        try:
            replays[name] = _captured_step(example)
        except Exception as e:  # torch refused something during capture: say what
            rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in replays}
    for _ in range(_GRAPH_REPEATS):  # interleaved, as the eager rows
        for name, replay in replays.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            replay()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    for undo in reversed(undos):
        undo()
    for name, ts in times.items():
        rows[name] = {"times_s": ts, "median_s": statistics.median(ts)}
    return rows


def run_shortops(dry: bool, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The short-op rows on ``device`` (tiny sizes in a dry run); graph rows on CUDA."""
    configs = shortops.QUICK if dry else shortops.CONFIGS
    out: dict[str, Any] = {}
    for name, sizes in configs.items():
        log(f"  short-op engine rows: {name} gpt {sizes} on {device}")
        measured = shortops.run_config(
            sizes, device=device, warmup=2 if dry else 5, repeats=3 if dry else 30, seed=0, log=log
        )
        if device == "cuda":
            graphs = graph_rows(sizes, measured["budgets"], {})
        else:
            graphs = {"skipped": "CUDA graphs need a CUDA device (CPU dry run)"}
        out[name] = {**measured, "graphs": graphs, "targets": shortops.report(name, measured)[1]}
    return out


def report_lines(shortops_data: dict[str, Any]) -> list[str]:
    """The report's section: each config's eager table and targets, then its graph rows."""
    lines = ["", "## The engine where ops are short (`benchmarks/engine_shortops.py`)", ""]
    for name, data in shortops_data.items():
        lines.append(shortops.report(name, data)[0])
        graphs = data.get("graphs", {})
        lines += ["", f"CUDA graphs of the whole step (`{name}`):", ""]
        if "skipped" in graphs:
            lines.append(f"- skipped: {graphs['skipped']}")
            continue
        plain = graphs.get("plain", {}).get("median_s")
        lines += ["| contender | replay (ms) | replay / plain replay |", "|---|---|---|"]
        for contender, row in graphs.items():
            if "error" in row:
                lines.append(f"| `{contender}` | not captured: {row['error']} | - |")
                continue
            ratio = "-" if not plain else f"{row['median_s'] / plain:.3f}"
            lines.append(f"| `{contender}` | {row['median_s'] * 1e3:.3f} | {ratio} |")
    return lines
