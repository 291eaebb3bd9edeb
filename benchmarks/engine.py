"""Engine benchmark: gradckpt's checkpoint mechanism against torch's, per block of a GPT.

Contenders (each on its own copy of the zoo GPT, same weights and batch):

* ``plain``: no checkpointing;
* ``torch_full``: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` per block;
* ``gradckpt_full``: ``gradckpt.checkpoint(block, x)`` per block (recompute everything);
* ``gradckpt_save_all``: ``gradckpt.checkpoint(block, x, policy=save_all)`` (keeps everything:
  only the per-op dispatch cost of the mechanism is left);
* ``gradckpt_save_matmuls``: ``policy=save_matmuls`` per block;
* ``torch_sac_matmuls``: torch selective checkpointing with the same op list
  (``gradckpt.policies.MATMUL_OPS``) per block.

With ``--short-ops`` it measures the regime a GPU runs in instead (ops of tens of
microseconds: the per-op cost of the engine shows), on two small GPTs, against
torch per block and torch SAC, and ``gradckpt.fit`` at three budgets
(:mod:`benchmarks.engine_shortops`); it writes ``engine-shortops-<where>-<date>``.

Usage:
    python -m benchmarks.engine            # full run (~10 min on 2 CPU cores)
    python -m benchmarks.engine --quick    # smoke test
    python -m benchmarks.engine --short-ops --threads 1 --repeats 60
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    RunClock,
    base_parser,
    fmt_ratio,
    gradckpt_checkpoint,
    info_block,
    load_note,
    machine_info,
    markdown_table,
    measure_contenders,
    measured_from_json,
    mib,
    per_block,
    plain,
    read_results,
    settle,
    torch_checkpoint,
    torch_sac,
    verdict,
    write_results,
)
from gradckpt import policies
from gradckpt.testing import make

FULL = dict(layers=8, d_model=512, heads=8, seq=512, vocab=2048, batch=4)
QUICK = dict(layers=4, d_model=64, heads=4, seq=64, vocab=256, batch=2)

TARGET_FULL = 1.03  # gradckpt full per block over torch full per block
TARGET_SAVE_ALL = 1.05  # gradckpt save_all per block over plain

DESCRIPTIONS = {
    "plain": "no checkpointing",
    "torch_full": "torch.utils.checkpoint per block",
    "gradckpt_full": "gradckpt.checkpoint per block",
    "gradckpt_save_all": "gradckpt.checkpoint per block, policy=save_all",
    "gradckpt_save_matmuls": "gradckpt.checkpoint per block, policy=save_matmuls",
    "torch_sac_matmuls": "torch SAC per block, MATMUL_OPS",
}


def contenders() -> dict:
    return {
        "plain": plain(),
        "torch_full": per_block(torch_checkpoint),
        "gradckpt_full": per_block(gradckpt_checkpoint(None)),
        "gradckpt_save_all": per_block(gradckpt_checkpoint(policies.save_all)),
        "gradckpt_save_matmuls": per_block(gradckpt_checkpoint(policies.save_matmuls)),
        "torch_sac_matmuls": per_block(torch_sac(sorted(policies.MATMUL_OPS, key=str))),
    }


def report(results: dict, info: dict) -> tuple[str, dict]:
    r = results
    base_peak = r["plain"].peak_bytes
    rows = [
        (
            f"`{name}`",
            DESCRIPTIONS[name],
            f"{m.timing.median:.3f}",
            fmt_ratio(m.ratio),
            fmt_ratio(m.min_ratio),
            mib(m.peak_bytes),
            f"{m.peak_bytes / base_peak:.3f}",
        )
        for name, m in r.items()
    ]
    table = markdown_table(
        [
            "contender",
            "what",
            "median step (s)",
            "time / plain",
            "fastest / plain's fastest",
            "peak (MiB)",
            "peak / plain",
        ],
        rows,
    )

    def over(a: str, b: str, attr: str) -> float:
        return getattr(r[a], attr) / getattr(r[b], attr)

    full_vs_torch = over("gradckpt_full", "torch_full", "ratio")
    save_all = r["gradckpt_save_all"].ratio
    sel_vs_sac = over("gradckpt_save_matmuls", "torch_sac_matmuls", "ratio")
    targets = [
        ("gradckpt full / torch full, time", f"<= {TARGET_FULL}", f"{full_vs_torch:.3f}",
         f"{over('gradckpt_full', 'torch_full', 'min_ratio'):.3f}",
         verdict(full_vs_torch <= TARGET_FULL)),
        ("gradckpt save_all / plain, time", f"<= {TARGET_SAVE_ALL}", f"{save_all:.3f}",
         f"{r['gradckpt_save_all'].min_ratio:.3f}", verdict(save_all <= TARGET_SAVE_ALL)),
        ("gradckpt save_matmuls / torch SAC, time", "report", f"{sel_vs_sac:.3f}",
         f"{over('gradckpt_save_matmuls', 'torch_sac_matmuls', 'min_ratio'):.3f}", "reported"),
        ("gradckpt full / torch full, peak", "report",
         f"{over('gradckpt_full', 'torch_full', 'peak_bytes'):.3f}", "", "reported"),
        ("gradckpt save_all / plain, peak", "report",
         f"{r['gradckpt_save_all'].peak_bytes / base_peak:.3f}", "", "reported"),
        ("gradckpt save_matmuls / torch SAC, peak", "report",
         f"{over('gradckpt_save_matmuls', 'torch_sac_matmuls', 'peak_bytes'):.3f}", "",
         "reported"),
    ]  # fmt: skip
    target_table = markdown_table(
        ["target", "wanted", "measured (medians)", "fastest runs", "verdict (medians)"], targets
    )
    losses = {m.loss for m in r.values()}
    md = "\n\n".join(
        [
            f"# Engine benchmark: checkpoint mechanisms per block, GPT on CPU ({info['date']})",
            "Each contender runs on its own copy of the zoo GPT (same seed, weights and batch). "
            "Times: interleaved rounds (A B C ... A B C ...), median after warm-up, as a ratio "
            "over `plain` measured in the same rounds; `fastest / plain's fastest` compares each "
            "contender's fastest run (the least disturbed one on a shared machine; verdicts use "
            "the medians). Peaks: one separate untimed step per "
            "contender under `gradckpt.measure.MemoryTracker` (params+buffers + peak live "
            "created storage).",
            *([note] if (note := load_note(info)) else []),
            table,
            "## Targets",
            target_table,
            f"Losses of the peak steps: {len(losses)} distinct value(s) "
            f"({', '.join(f'{x:.6f}' for x in sorted(losses))}).",
            "## Setup",
            info_block(info),
        ]
    )
    data = {
        "info": info,
        "results": {name: m.to_json() for name, m in r.items()},
        "targets": {
            "gradckpt_full_over_torch_full": full_vs_torch,
            "gradckpt_save_all_over_plain": save_all,
            "gradckpt_save_matmuls_over_torch_sac": sel_vs_sac,
            "fastest_runs": {
                "gradckpt_full_over_torch_full": over("gradckpt_full", "torch_full", "min_ratio"),
                "gradckpt_save_all_over_plain": r["gradckpt_save_all"].min_ratio,
                "gradckpt_save_matmuls_over_torch_sac": over(
                    "gradckpt_save_matmuls", "torch_sac_matmuls", "min_ratio"
                ),
            },
        },
    }
    return md, data


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout of the GPT (default %(default)s: SDPA uses the flash kernel on CPU)",
    )
    p.add_argument(
        "--layers", type=int, default=None, help=f"GPT blocks (default {FULL['layers']})"
    )
    p.add_argument(
        "--vocab", type=int, default=None, help=f"GPT vocabulary (default {FULL['vocab']})"
    )
    p.add_argument(
        "--short-ops",
        action="store_true",
        help="the short-op table (a GPU's regime) instead: benchmarks/engine_shortops.py",
    )
    args = p.parse_args(argv)  # fmt: skip
    settle(args)
    if args.short_ops:
        return short_ops(args)
    if args.from_json is not None:
        saved = read_results(args.from_json)
        results = measured_from_json(saved["results"], "plain")
        md, data = report(results, saved["info"])
        md_path, json_path = write_results(args.out, "engine", md, data, saved["info"]["date"])
        print(md)
        print(f"\nre-rendered {md_path} and {json_path} from {args.from_json}")
        return 0
    sizes = dict(QUICK if args.quick else FULL, dropout=args.dropout)
    if args.layers is not None:
        sizes["layers"] = args.layers
    if args.vocab is not None:
        sizes["vocab"] = args.vocab
    clock = RunClock.start()
    print(f"engine benchmark: gpt {sizes}, warmup {args.warmup}, repeats {args.repeats}")
    results = measure_contenders(
        lambda: make("gpt", **sizes), contenders(), baseline="plain",
        warmup=args.warmup, repeats=args.repeats, seed=args.seed,
    )  # fmt: skip
    info = machine_info(
        model="gpt (gradckpt.testing)",
        sizes=sizes,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        quick=args.quick,
        **clock.info(),
    )
    md, data = report(results, info)
    md_path, json_path = write_results(args.out, "engine", md, data)
    print(md)
    print(f"\nwrote {md_path} and {json_path}")
    return 0


def short_ops(args) -> int:
    """``--short-ops``: every config of :mod:`benchmarks.engine_shortops`, one report
    (``--from-json``: re-rendered from an earlier run's JSON, nothing measured)."""
    from benchmarks import engine_shortops as shortops

    if args.from_json is not None:
        saved = read_results(args.from_json)
        info, data = saved["info"], saved["configs"]
        sections = [shortops.report(name, config)[0] for name, config in data.items()]
    else:
        configs = shortops.QUICK if args.quick else shortops.CONFIGS
        clock = RunClock.start()
        warmup = max(args.warmup, 2)
        sections, data = shortops.main_sections(
            configs, device="cpu", warmup=warmup, repeats=args.repeats, seed=args.seed
        )
        info = machine_info(
            model="gpt (gradckpt.testing)", warmup=warmup, repeats=args.repeats,
            seed=args.seed, quick=args.quick, clock="thread CPU time", **clock.info(),
        )  # fmt: skip
    md = "\n\n".join(
        [
            f"# Engine benchmark where ops are short (a GPU's regime), CPU ({info['date']})",
            shortops.__doc__.split("\n\n")[1],
            *([note] if (note := load_note(info)) else []),
            *sections,
            "## Setup",
            info_block(info),
        ]
    )
    md_path, json_path = write_results(
        args.out, "engine-shortops", md, {"info": info, "configs": data}, info["date"]
    )
    print(md)
    print(f"\nwrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
