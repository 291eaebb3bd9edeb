"""The harness every benchmark script shares: contenders, steps, rounds, statistics, machine,
results; a script adds its contenders and its table.

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

Modules: ``contenders`` (installers), ``steps`` (a step, its peak, device chores),
``rounds`` (peaks then interleaved timing of a contender set), ``stats`` (ratios,
spreads, bootstrap intervals), ``machine`` (environment, load, rerun line),
``results`` (file names, writer, Markdown cells), ``cli`` (shared flags). Their
public names are importable from here.
"""

from benchmarks.harness.cli import base_parser, settle, unknown_models
from benchmarks.harness.contenders import (
    Installer,
    Undo,
    gradckpt_checkpoint,
    library_checkpointing,
    per_block,
    plain,
    torch_checkpoint,
    torch_sac,
    with_plan,
    wrap_blocks,
)
from benchmarks.harness.machine import (
    SPEED_VARIABLES,
    RunClock,
    cpu_model,
    load_average,
    load_note,
    machine_info,
    rerun_command,
    speed_environment,
)
from benchmarks.harness.results import (
    RESULTS,
    MiB,
    fmt_interval,
    fmt_ratio,
    hardware_slug,
    info_block,
    markdown_table,
    mib,
    read_results,
    rerender,
    results_path,
    verdict,
    write_results,
)
from benchmarks.harness.rounds import Measured, measure_contenders, measured_from_json
from benchmarks.harness.stats import (
    fastest_ratio,
    median_interval,
    median_spread,
    paired_ratios,
    paired_stats,
    pooled,
)
from benchmarks.harness.steps import (
    clear_grads,
    make_step,
    measure_peak,
    measure_peaks,
    release,
    step_clock,
    sync,
    wall_timed,
)

__all__ = [
    "RESULTS",
    "SPEED_VARIABLES",
    "Installer",
    "Measured",
    "MiB",
    "RunClock",
    "Undo",
    "base_parser",
    "clear_grads",
    "cpu_model",
    "fastest_ratio",
    "fmt_interval",
    "fmt_ratio",
    "gradckpt_checkpoint",
    "hardware_slug",
    "info_block",
    "library_checkpointing",
    "load_average",
    "load_note",
    "machine_info",
    "make_step",
    "markdown_table",
    "measure_contenders",
    "measure_peak",
    "measure_peaks",
    "measured_from_json",
    "median_interval",
    "median_spread",
    "mib",
    "paired_ratios",
    "paired_stats",
    "per_block",
    "plain",
    "pooled",
    "read_results",
    "release",
    "rerender",
    "rerun_command",
    "results_path",
    "settle",
    "speed_environment",
    "step_clock",
    "sync",
    "torch_checkpoint",
    "torch_sac",
    "unknown_models",
    "verdict",
    "wall_timed",
    "with_plan",
    "wrap_blocks",
    "write_results",
]  # fmt: skip
