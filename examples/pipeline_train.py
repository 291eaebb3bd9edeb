"""Train a GPT split in pipeline stages, each stage planned for the micro-batches it keeps in flight.

    torchrun --nproc_per_node=2 examples/pipeline_train.py
    torchrun --nproc_per_node=4 examples/pipeline_train.py --schedule gpipe --budget 40MiB

One stage per rank (``torch.distributed.pipelining``: ``PipelineStage`` and
``Schedule1F1B`` or ``ScheduleGPipe``), CPU with gloo. Every rank profiles its own
stage on one micro-batch and plans it for the same budget in bytes (the whole step:
AdamW's state, gradients accumulated over the micro-batches, the schedule's
communication buffers), holding as many micro-batches as its schedule keeps in
flight; rank 0 prints every stage's plan, and on the last step every rank's
allocator high-water against the budget and its prediction.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from gradckpt.integrations.pipeline import fit_stage, gather_stage_plans, summary
from gradckpt.measure import AllocatorTracker, format_bytes
from gradckpt.testing.pipelines import gpt_stages, next_token_loss

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="24MiB", help="bytes per rank: '24MiB', 25000000")
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    return parser.parse_args()  # fmt: skip


def main() -> None:
    args = _args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    budget = int(args.budget) if args.budget.isdigit() else args.budget
    sizes = dict(layers=args.layers, d_model=args.d_model, heads=4, seq=args.seq, vocab=args.vocab)
    module = gpt_stages(world, **sizes)[rank]  # same seed everywhere: this rank keeps its stage

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mb = args.batch // args.microbatches
    # One micro-batch of what this stage receives: tokens, or the previous stage's output.
    inputs = (x[:mb],) if rank == 0 else (torch.randn(mb, args.seq, args.d_model),)

    plan = fit_stage(
        module, inputs, budget, schedule=args.schedule, stage_index=rank, num_stages=world,
        n_microbatches=args.microbatches, loss=next_token_loss, target=y[:mb],
        optimizer="adamw", return_outputs=False,
    )  # fmt: skip
    plans = gather_stage_plans(plan)
    if rank == 0:
        print(summary(plans), flush=True)

    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=next_token_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    with AllocatorTracker() as at:  # every step, from the first (buffers, optimizer state)
        for step in range(args.steps):
            opt.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(x, return_outputs=False)
            elif rank == world - 1:
                schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
            opt.step()
            if rank == world - 1:
                print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}", flush=True)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    peak = params + at.peak_bytes
    for r in range(world):
        dist.barrier()
        if r == rank:
            print(f"rank {rank}: peak {format_bytes(peak)} (predicted "
                  f"{format_bytes(plan.predicted_peak_bytes)}, budget "
                  f"{format_bytes(plan.budget_bytes)})", flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
