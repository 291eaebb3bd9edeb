"""``gradckpt estimate|plan TARGET --stages N``: a pipeline's per-stage plans, under fake tensors.

The target is a built-in decoder split in ``N`` stages (blocks evenly, the
embeddings on the first, the final norm, head and loss on the last), built on
the meta device and profiled under fake tensors stage by stage: nothing is
allocated, so a Llama-3-8B shape plans on a laptop. Each stage is planned for the
micro-batches its schedule keeps in flight
(:func:`gradckpt.integrations.pipeline.plan_stages`) and the table shows, per
stage: in flight, plan, predicted peak (the whole step: parameters, gradients,
optimizer state, communication buffers) and time per micro-batch (estimated for
this machine's CPU: fake profiles have no measured times), and the best uniform
setting that fits every stage. A model of your own: call ``plan_stages`` (or
``plan_stage`` on each rank) in Python.

Example:
    $ gradckpt estimate llama3-8b --stages 4 --schedule 1f1b --microbatches 8 \\
        --optimizer adamw --budget 60GiB
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch

from gradckpt.cli.extras import CliError
from gradckpt.cli.output import Out

__all__ = ["PIPELINES", "add_pipeline_flags", "run_pipeline"]


@dataclass(frozen=True)
class PipelineTarget:
    """A built-in decoder to split in stages: ``gpt_stages`` arguments and batch shape."""

    description: str
    sizes: dict[str, Any]
    seq: int
    microbatch: int  # samples per micro-batch
    dtype: torch.dtype = torch.float32


PIPELINES = {
    "llama3-8b": PipelineTarget(
        "Llama-3-8B-shaped (32 layers, hidden 4096, MLP 14336, 8 key/value heads, vocabulary "
        "128256), bf16, micro-batches of 1 x 8192 tokens",
        dict(kind="llama", layers=32, d_model=4096, heads=32, hidden=14336, kv_heads=8,
             vocab=128256),
        seq=8192, microbatch=1, dtype=torch.bfloat16,
    ),
    "tiny-gpt": PipelineTarget(
        "GPT from gradckpt.testing: 8 layers, d_model 128, vocab 512, micro-batches of 2 x 128",
        dict(kind="gpt", layers=8, d_model=128, heads=4, vocab=512), seq=128, microbatch=2,
    ),
}  # fmt: skip


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    """``--stages``, ``--schedule``, ``--microbatches``: plan a pipeline instead of one model."""
    p.add_argument(
        "--stages", type=int, default=None, metavar="N",
        help=f"split a built-in decoder ({', '.join(PIPELINES)}) in N pipeline stages and plan "
        "each for the micro-batches its schedule keeps in flight (fake tensors)",
    )  # fmt: skip
    p.add_argument(
        "--schedule", default="1f1b", metavar="NAME",
        help="with --stages: 1f1b (default) or gpipe (interleaved and zero-bubble schedules "
        "are refused, saying why)",
    )  # fmt: skip
    p.add_argument(
        "--microbatches", type=int, default=None, metavar="M",
        help="with --stages: micro-batches per step (default: twice the stages)",
    )  # fmt: skip


def _stages(target: PipelineTarget, n: int) -> list[tuple[torch.nn.Module, tuple]]:
    from gradckpt.testing.pipelines import gpt_stages

    sizes = dict(target.sizes)
    modules = gpt_stages(n, seq=target.seq, dtype=target.dtype, device="meta", **sizes)
    ids = torch.zeros(target.microbatch, target.seq, dtype=torch.long)
    hidden = torch.zeros(target.microbatch, target.seq, sizes["d_model"], dtype=target.dtype)
    return [(m, (ids,) if i == 0 else (hidden,)) for i, m in enumerate(modules)]


def run_pipeline(args: argparse.Namespace, out: Out, *, budget_required: bool) -> int:
    """Plan every stage of ``args.target`` split in ``args.stages`` and print the table."""
    from gradckpt.integrations.pipeline import plan_stages
    from gradckpt.integrations.pipeline_report import compare, summary
    from gradckpt.integrations.pipeline_schedules import schedule_name
    from gradckpt.testing.pipelines import next_token_loss

    if args.target not in PIPELINES:
        raise CliError(
            f"--stages splits a built-in decoder ({', '.join(PIPELINES)}), not {args.target!r}; "
            "for your own model call gradckpt.integrations.pipeline.plan_stages in Python"
        )
    if args.stages < 2:
        raise CliError(f"--stages is at least 2 (a pipeline), got {args.stages}")
    try:
        schedule = schedule_name(args.schedule)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    m = args.microbatches or 2 * args.stages
    if schedule == "1f1b" and m < args.stages:
        raise CliError(f"1F1B needs at least as many micro-batches as stages: --microbatches "
                       f">= {args.stages}, got {m}")  # fmt: skip
    budget = args.budget
    if budget is None and budget_required:
        raise CliError("--budget is the device's bytes per rank, e.g. 80GB")
    if isinstance(budget, float) or budget in ("least", "auto"):
        raise CliError(
            "with --stages, --budget is bytes per rank (80GB, 60GiB): the stages' peaks differ, "
            "so one fraction would mean different bytes on each"
        )
    target = PIPELINES[args.target]
    with out.status(f"planning {args.stages} stages of {args.target} under fake tensors ..."):
        stages = _stages(target, args.stages)
        target_ids = stages[0][1][0]
        plans = plan_stages(
            stages, schedule, budget if budget is not None else 1 << 62, n_microbatches=m,
            loss=next_token_loss, target=target_ids, optimizer=None if args.optimizer == "none"
            else args.optimizer, fake=True, repeats=1, chunking=False,
        )  # fmt: skip
    if getattr(args, "json", False):
        c = compare(plans)
        out.json({"kind": "gradckpt.PipelineEstimate", "target": args.target,
                  "stages": [p.to_json() for p in plans], "uniform_best": c.uniform_name,
                  "predicted_step_time": c.step_time})  # fmt: skip
        return 0
    print(f"{args.target}: {target.description}")
    print(
        summary(plans)
        if budget is not None
        else summary(plans).replace(
            f"budget {plans[0].budget_bytes / 2**30:.2f} GiB per rank", "no budget (plain peaks)"
        )
    )
    if getattr(args, "out", None) and budget_required:
        path = args.out
        with open(path, "w") as f:
            json.dump([p.to_json() for p in plans], f)
        print(f"wrote {len(plans)} stage plans to {path} (StagePlan.from_json each)")
    return 0
