"""Planning's own memory against a byte budget, at malloc's level (#40 item 3).

Each model runs in a child interpreter under a preloaded malloc counter
(``gradckpt.testing.malloc_counter``). The plain step is profiled first (the
library's code loads then, once per process), then ``fit`` at 0.6, 0.9, 1.05 and
1.2x the plain step's allocator peak and ``tune`` at 0.6 and 0.9x the plain whole
step (AdamW, global batch 8): each call's high-water is the model's parameters and
buffers plus the most malloc held above the call's start (profiling, the real
runs of a fake profile's ops, the malloc probe's held chunks, candidate steps,
the planner's own objects). Target: every call within its budget, a refusal too.

Memory only: nothing is timed, so the numbers do not depend on the machine's load.

Usage:
    python -m benchmarks.planning_memory            # four models (several minutes)
    python -m benchmarks.planning_memory --quick    # one small model, fit only
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    RunClock,
    base_parser,
    info_block,
    machine_info,
    markdown_table,
    mib,
    read_results,
    rerun_command,
    verdict,
    write_results,
)
from gradckpt.testing.malloc_counter import build_counter, run_counted

FIT_SHARES, TUNE_SHARES = (0.6, 0.9, 1.05, 1.2), (0.6, 0.9)

# In the child: sys.argv[1] is [zoo name, sizes, fit shares, tune shares, threads].
CHILD = textwrap.dedent(
    """
    import ctypes, gc, json, sys, time
    import torch
    import gradckpt
    from gradckpt.measure import state_bytes
    from gradckpt.planning.solving.budget import BudgetError
    from gradckpt.testing import make
    from gradckpt.tuning import tune

    name, sizes, fit_shares, tune_shares, threads = json.loads(sys.argv[1])
    torch.set_num_threads(threads)
    lib = ctypes.CDLL(None)
    lib.gck_peak.restype = lib.gck_current.restype = ctypes.c_longlong

    def counted(model, call):
        gc.collect()
        base = lib.gck_current()
        lib.gck_reset_peak()
        start, refused = time.perf_counter(), ""
        try:
            call()
        except BudgetError as e:
            refused = str(e)
        seconds = time.perf_counter() - start
        high = state_bytes(model) + lib.gck_peak() - base
        gradckpt.remove(model)
        return high, refused, seconds

    ex = make(name, **sizes)
    rows = []
    plain = gradckpt.profile(ex.model, ex.loss_fn).measured_peak_bytes  # loads the library
    for share in fit_shares:
        budget = int(share * plain)
        high, refused, s = counted(ex.model, lambda: gradckpt.fit(ex.model, ex.loss_fn, budget))
        rows.append(["fit", share, budget, high, refused, s])
    if tune_shares:
        keys = list(ex.inputs)
        from gradckpt.testing.example import classification_loss
        from gradckpt.testing.gpts import _next_token_loss
        loss_of = ((lambda rows_b: _next_token_loss(ex.model, rows_b)) if name == "gpt"
                   else (lambda rows_b: classification_loss(ex.model, rows_b)))
        def make_loss(b):
            rows_b = {k: v[:b] for k, v in ex.inputs.items()}
            return lambda: loss_of(rows_b)
        opt = torch.optim.AdamW(ex.model.parameters())
        batch = ex.inputs[keys[0]].shape[0]
        whole = gradckpt.profile(ex.model, make_loss(batch), optimizer=opt).measured_peak_bytes
        for share in tune_shares:
            budget = int(share * whole)
            call = lambda: tune(ex.model, make_loss, budget, optimizer=opt, global_batch=batch,
                                rounds=1)
            high, refused, s = counted(ex.model, call)
            rows.append(["tune", share, budget, high, refused, s])
    print(json.dumps({"plain": plain, "rows": rows}))
    """
)


def models(quick: bool) -> dict[str, tuple[str, dict[str, Any], tuple, tuple]]:
    if quick:
        return {"resnet-48": ("resnet", {"image": 48, "batch": 8}, (0.6, 1.2), ())}
    return {
        "resnet-64": ("resnet", {"image": 64, "batch": 8}, FIT_SHARES, TUNE_SHARES),
        "unet-128": ("unet", {"image": 128, "batch": 4}, FIT_SHARES, ()),
        "atrous-128": ("atrous", {"image": 128, "channels": 64, "batch": 4}, FIT_SHARES, ()),
        "gpt": ("gpt", {"layers": 3, "d_model": 64, "seq": 64, "vocab": 256, "batch": 8},
                FIT_SHARES, TUNE_SHARES),
    }  # fmt: skip


def report(data: dict[str, Any]) -> str:
    rows = []
    for name, got in data["models"].items():
        for verb, share, budget, high, refused, seconds in got["rows"]:
            rows.append([name, f"`{verb}`", f"{share:.2f}x", mib(budget), mib(high),
                         f"{high / budget:.3f}", refused.split(":")[0][:60] if refused else "",
                         f"{seconds:.1f}", verdict(high <= budget)])  # fmt: skip
    return "\n\n".join([
        "# Planning's own memory against a byte budget, at malloc's level (#40)",
        __doc__.split("\n\n")[1] if __doc__ else "",
        markdown_table(["model", "call", "budget (x plain)", "budget (MiB)",
                        "high-water (MiB)", "high-water / budget", "refused", "s",
                        "within the budget"], rows),
        info_block(data["info"]),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    args = p.parse_args(argv)
    if args.from_json:
        data = read_results(args.from_json)
        print(report(data))
        write_results(args.out, "planning-memory", report(data), data)
        return 0
    lib = build_counter(Path(tempfile.mkdtemp(prefix="gradckpt-counter-")))
    if lib is None:
        p.error("the malloc counter needs a C compiler and glibc (Linux)")
    clock = RunClock.start()
    results = {}
    for name, (zoo, sizes, fit_shares, tune_shares) in models(args.quick).items():
        results[name] = run_counted(lib, CHILD, [zoo, sizes, fit_shares, tune_shares, args.threads])
        print(f"{name}: " + ", ".join(f"{r[0]} {r[1]}x {r[3] / r[2]:.3f}" for r in results[name]["rows"]))
    info = machine_info(quick=args.quick, threads_in_children=args.threads,
                        rerun=rerun_command("benchmarks.planning_memory", argv), **clock.info())  # fmt: skip
    data = {"info": info, "models": results}
    text = report(data)
    print(text)
    write_results(args.out, "planning-memory", text, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
