"""Pipeline stages (#43): a plan per stage against one setting for every stage, on gloo ranks.

A decoder split in two stages (``gradckpt.testing.pipelines``: embeddings and half
the blocks on stage 0; the other half, the final norm and the head on stage 1)
runs under ``Schedule1F1B`` on 2 CPU ranks (gloo, one thread each), AdamW, so
stage 0 holds 2 micro-batches in flight and stage 1 one. Each rank profiles its
own stage and plans it (``plan_stage``); the predictions are gathered.

The budget: the least at which stage 1 keeps everything, or halfway between
stage 0's plain peak and its peak with every block recomputed if that is more.
It is stated in the results with the rule, and it fits stage 0 only with
recompute.

Contenders, each on both ranks in lock-step, interleaved round by round:

* ``per-stage``: each stage its own plan;
* ``uniform <setting>``: the best uniform setting (predicted) that fits every
  stage, the same plan kind on every stage as torchtitan and Megatron apply it;
* ``every_block``: torchtitan's ``full`` mode on every stage (if it is not the above);
* ``plain``: no checkpointing (does not fit the budget; for reference).

Step time: rank 0's wall time of ``schedule.step`` and ``optimizer.step()`` between
barriers; the ratio per round over the per-stage plans', median with a bootstrap
95% interval. Per stage: each rank's thread time in its forward and backward
chunks (and the last stage's loss) per micro-batch, against ``plan_stage``'s predicted time per micro-batch.
Peaks: each rank's allocator high-water over its first 2 whole steps (untimed;
parameters included, and everything made from the first step on: gradients,
optimizer state, communication buffers).

Usage:
    python -m benchmarks.pipeline            # GPT, 8 blocks, d 128, 8 micro-batches
    python -m benchmarks.pipeline --quick    # tiny sizes, a smoke run
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.harness import base_parser, info_block, machine_info, markdown_table, settle
from benchmarks.harness.results import read_results, write_results
from benchmarks.harness.stats import median_interval

WORLD = 2
FULL = dict(layers=8, d_model=128, heads=4, seq=128, vocab=512, batch=16, microbatches=8)
QUICK = dict(layers=4, d_model=64, heads=4, seq=32, vocab=256, batch=8, microbatches=4)


def _sizes(cfg: dict[str, int]) -> dict[str, int]:
    return {k: cfg[k] for k in ("layers", "d_model", "heads", "seq", "vocab")}


def _batch(cfg: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class _Run:
    """One contender on this rank: its stage module, schedule, optimizer, chunk timer."""

    def __init__(self, module: torch.nn.Module, rank: int, cfg: dict[str, int]) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from gradckpt.testing.pipelines import next_token_loss

        self.module, self.rank = module, rank
        self.x, self.y = _batch(cfg)
        stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, cfg["microbatches"], loss_fn=next_token_loss)
        self.opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        self.chunk_seconds = 0.0
        # The stage's work per micro-batch: forward, backward, and the last stage's loss
        # (the schedule computes it; the predicted time includes it).
        owners = [(stage, "forward_one_chunk"), (stage, "backward_one_chunk"),
                  (self.schedule, "_maybe_compute_loss")]  # fmt: skip
        for owner, name in owners:
            original = getattr(owner, name)

            def timed(*a: Any, _original: Any = original, **k: Any) -> Any:
                start = time.thread_time()
                out = _original(*a, **k)
                self.chunk_seconds += time.thread_time() - start
                return out

            setattr(owner, name, timed)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(self.x, return_outputs=False)
        else:
            self.schedule.step(target=self.y, losses=[], return_outputs=False)
        self.opt.step()


def _rank_main(cfg: dict[str, int], rounds: int, warmup: int, out: Path) -> None:
    import torch.distributed as dist

    import gradckpt
    from gradckpt.integrations.pipeline import plan_stage
    from gradckpt.integrations.pipeline_report import compare, gather_stage_plans, summary
    from gradckpt.measure import AllocatorTracker
    from gradckpt.planning.solving.baselines import every_kth_plan, none_plan, save_matmuls_plan
    from gradckpt.testing.pipelines import gpt_stages, next_token_loss

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    m = cfg["microbatches"]
    mb = cfg["batch"] // m
    x, y = _batch(cfg)
    build = lambda: gpt_stages(WORLD, **_sizes(cfg))[rank]  # noqa: E731 - same init each time
    inputs = (x[:mb],) if rank == 0 else (torch.randn(mb, cfg["seq"], cfg["d_model"]),)
    options = dict(schedule="1f1b", stage_index=rank, num_stages=WORLD, n_microbatches=m,
                   loss=next_token_loss, target=y[:mb], optimizer="adamw",
                   return_outputs=False, repeats=3)  # fmt: skip
    # Probe: every stage's plain and every-block peaks under a huge budget, then the budget.
    probe = gather_stage_plans(plan_stage(build(), inputs, 1 << 40, **options))
    full = {u.name: u.peak_bytes for u in probe[0].uniform}
    budget = max(probe[1].plain_peak_bytes, (probe[0].plain_peak_bytes + full["every_block"]) // 2)
    module = build()
    mine = plan_stage(module, inputs, budget, **options)
    plans = gather_stage_plans(mine)
    comparison = compare(plans)
    contenders: dict[str, Any] = {"per-stage": mine.plan}
    makers = {"every_block": lambda p: every_kth_plan(p, 1),
              "every_2nd_block": lambda p: every_kth_plan(p, 2),
              "save_matmuls": save_matmuls_plan, "none": none_plan}  # fmt: skip
    uniform_names = [comparison.uniform_name] if comparison.uniform_name else []
    if "every_block" not in uniform_names:
        uniform_names.append("every_block")
    runs = {"per-stage": _Run(module, rank, cfg)}
    gradckpt.apply(module, mine.plan)
    for name in uniform_names:
        mod = build()
        prof = gradckpt.profile(mod, lambda mod=mod: next_token_loss(mod(inputs[0]), y[:mb])
                                if rank == 1 else mod(inputs[0]).sum(), repeats=1)  # fmt: skip
        plan = makers[name](prof)
        gradckpt.apply(mod, plan)
        contenders[f"uniform {name}"] = plan
        runs[f"uniform {name}"] = _Run(mod, rank, cfg)
    runs["plain"] = _Run(build(), rank, cfg)
    peaks = {}
    for name, run in runs.items():  # 2 untimed steps each, from the start: the high-water
        dist.barrier()
        with AllocatorTracker() as at:
            run.step()
            run.step()
        params = sum(p.numel() * p.element_size() for p in run.module.parameters())
        peaks[name] = params + at.peak_bytes
        dist.barrier()
    times: dict[str, list[float]] = {name: [] for name in runs}
    chunk: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(warmup + rounds):
        for name, run in runs.items():
            dist.barrier()
            run.chunk_seconds = 0.0
            start = time.perf_counter()
            run.step()
            dist.barrier()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
                chunk[name].append(run.chunk_seconds / m)
    result = {
        "rank": rank, "budget": budget, "plans": [p.to_json() for p in plans],
        "summary": summary(plans), "peaks": peaks, "times": times, "chunk": chunk,
        "uniform_predicted": {n: [next(u for u in p.uniform if u.name == n).__dict__
                                  for p in plans] for n in uniform_names},
    }  # fmt: skip
    box: list[Any] = [None] * WORLD
    dist.all_gather_object(box, result)
    if rank == 0:
        out.write_text(json.dumps(box, default=str))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _launch(cfg: dict[str, int], rounds: int, warmup: int) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        procs = []
        for rank in range(WORLD):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                   os.environ.get("PYTHONPATH", "")]))  # fmt: skip
            args = [sys.executable, "-m", "benchmarks.pipeline", "--rank-run", json.dumps(cfg),
                    str(rounds), str(warmup), str(out)]  # fmt: skip
            procs.append(subprocess.Popen(args, env=env, cwd=Path(__file__).resolve().parents[1]))
        codes = [p.wait(timeout=3600) for p in procs]
        if any(codes):
            raise SystemExit(f"ranks failed: exit codes {codes}")
        return json.loads(out.read_text())


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def render(data: dict[str, Any]) -> str:
    """The Markdown report from the data a run wrote."""
    ranks = data["ranks"]
    budget = ranks[0]["budget"]
    lines = [
        "# Pipeline stages: a plan per stage vs one setting for every stage (#43)",
        "",
        info_block(data["info"]),
        "",
        f"Schedule1F1B, {WORLD} stages on {WORLD} gloo ranks (one thread each), "
        f"{data['config']['microbatches']} micro-batches, AdamW. Budget {budget / 2**20:.2f} MiB "
        "per rank: the least at which stage 1 keeps everything, or halfway between stage 0's "
        "plain peak and its every-block peak if that is more.",
        "",
        "## The per-stage plans (predicted)",
        "",
        "```",
        ranks[0]["summary"],
        "```",
        "",
        "## Measured",
        "",
    ]
    names = list(ranks[0]["times"])
    base = ranks[0]["times"]["per-stage"]
    rows = []
    for name in names:
        ratios = [t / b for t, b in zip(ranks[0]["times"][name], base)]
        med, lo, hi = median_interval(ratios)
        peaks = " / ".join(f"{r['peaks'][name] / 2**20:.2f}" for r in ranks)
        fits = all(r["peaks"][name] <= budget for r in ranks)
        rows.append([name, peaks, "yes" if fits else "no",
                     _ms(sorted(ranks[0]["times"][name])[len(base) // 2]),
                     f"{med:.3f} [{lo:.3f}, {hi:.3f}]"])  # fmt: skip
    lines.append(markdown_table(
        ["contender", "peak MiB (rank 0 / rank 1)", "fits", "step (median)",
         "step time / per-stage's (median, 95% interval)"], rows))  # fmt: skip
    lines += ["", "## Time per micro-batch per stage: predicted vs measured", ""]
    rows = []
    for r in ranks:
        plan = r["plans"][r["rank"]]
        predicted = {"per-stage": plan["time_per_microbatch"],
                     "plain": plan["plain_time_per_microbatch"]}  # fmt: skip
        predicted.update(
            {f"uniform {u['name']}": u["time_per_microbatch"] for u in plan["uniform"]}
        )
        for name in names:
            measured = sorted(r["chunk"][name])[len(r["chunk"][name]) // 2]
            if name not in predicted or measured <= 0:
                continue
            error = predicted[name] / measured - 1
            _, lo, hi = median_interval(r["chunk"][name])
            rows.append([r["rank"], name, plan["in_flight"], _ms(predicted[name]), _ms(measured),
                         f"[{lo * 1e3:.1f}, {hi * 1e3:.1f}]", f"{error:+.1%}",
                         "yes" if abs(error) <= 0.15 else "no"])  # fmt: skip
    lines.append(markdown_table(
        ["stage", "contender", "in flight", "predicted", "measured (median, thread time in its "
         "chunks)", "95% interval", "predicted / measured - 1", "within 15%"], rows))  # fmt: skip
    lines += ["", "The plain rows show how much of the error is the stage's plain step (timed "
              "with every rank timing its own stage at once) rather than the recompute priced "
              "on top of it."]  # fmt: skip
    if "load_average" in data:
        before, after = data["load_average"]["before"], data["load_average"]["after"]
        lines += [
            "",
            "Load average (1, 5, 15 min) before the run: "
            + ", ".join(f"{v:.2f}" for v in before)
            + "; after: "
            + ", ".join(f"{v:.2f}" for v in after)
            + f" ({os.cpu_count()} cores).",
        ]
    plans = ranks[0]["plans"]
    ticks = data["config"]["microbatches"] + WORLD - 1
    predicted_step = ticks * max(p["time_per_microbatch"] for p in plans)
    measured_step = sorted(base)[len(base) // 2]
    lines += [
        "",
        "## Notes",
        "",
        f"- Predicted pipeline step ((M + P - 1) x the slowest stage's time per micro-batch): "
        f"{_ms(predicted_step)}; measured median {_ms(measured_step)}. The prediction leaves "
        "out gloo's send/recv, the schedule's bookkeeping and the two ranks sharing this "
        "machine's cores with other work; it ranks plans by their slowest stage only, so it "
        "calls a uniform setting that matches the slowest stage's plan a tie, while the "
        "measurement also sees the other stages' recompute.",
        "- Peaks are each rank's allocator high-water (torch's CPU allocator events), not "
        "malloc's: the budget is planned at the allocator's level.",
        "- The budget rule is stated above; it is chosen so stage 0 needs recompute and stage "
        "1 does not, the case the per-stage plans are for.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank-run":
        _rank_main(json.loads(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4]))
        return
    parser = base_parser(__doc__.split("\n")[0])
    args = parser.parse_args(argv)
    settle(args)
    if args.from_json:
        data = read_results(args.from_json)
    else:
        cfg = QUICK if args.quick else FULL
        load_before = os.getloadavg()
        ranks = _launch(cfg, args.repeats, args.warmup)
        data = {"info": machine_info(threads_per_rank=1, ranks=WORLD, rounds=args.repeats,
                                     warmup=args.warmup, quick=args.quick),
                "config": cfg, "ranks": ranks,
                "load_average": {"before": load_before, "after": os.getloadavg()}}  # fmt: skip
    md, js = write_results(args.out, "pipeline", render(data), data)
    print(md.read_text())
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
