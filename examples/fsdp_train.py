"""Train a small GPT with FSDP2 under a per-rank memory budget that gradckpt plans for.

    torchrun --nproc_per_node=2 examples/fsdp_train.py
    torchrun --nproc_per_node=2 examples/fsdp_train.py --budget 0.6 --steps 5 --layers 6

CPU with gloo when no GPU is present; one GPU per rank with NCCL otherwise,
unchanged. The order is the one torchtitan uses: plan and apply on the whole
(unsharded) model, then (optionally compile, then) ``fully_shard`` each block
and the root. Rank 0 profiles and plans; every rank applies the same plan.
Each step prints the loss and, on the last step, every rank's measured peak
(gradckpt's definition: its parameter shards and buffers plus the storage
created during the step, FSDP's gathered parameters included) against the
budget and the plan's prediction.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from gradckpt.integrations.distributed import RankMemoryTracker, fit_for_fsdp
from gradckpt.measure import format_bytes
from gradckpt.testing import gpt


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget",
        default="0.6",
        help="per-rank budget: bytes, '300MB', or a fraction of the plain peak",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    return parser.parse_args()  # fmt: skip


def _budget(text: str) -> int | float | str:
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def main() -> None:
    args = _args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    # Same weights on every rank (seed 0); each rank its own tokens.
    example = gpt(layers=args.layers, d_model=args.d_model, heads=args.heads, seq=args.seq,
                  vocab=args.vocab, batch=args.batch, device=device)  # fmt: skip
    model = example.model
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1 + rank)).to(device)  # fmt: skip
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn() -> torch.Tensor:
        logits = model(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    plan = fit_for_fsdp(model, loss_fn, _budget(args.budget))  # 1. plan + apply (rank 0 plans)
    if rank == 0:
        print(f"world {world} on {device.type} ({dist.get_backend()})")
        print(plan.summary())
    for block in model.blocks:  # 2. (compile here) 3. shard
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        last = step == args.steps - 1
        torch.manual_seed(100 * step + rank)  # dropout
        tracker = RankMemoryTracker(model) if last else None
        if tracker is not None:
            tracker.__enter__()
        try:
            loss = loss_fn()
            loss.backward()
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {mean.item() / world:.4f}")
        if last:
            line = (
                f"rank {rank}: peak {format_bytes(tracker.peak_bytes)} "
                f"(budget {format_bytes(plan.budget_bytes)}, predicted "
                f"{format_bytes(plan.predicted_peak_bytes)})"
            )
            if tracker.device_peak_bytes is not None:
                line += (
                    f", CUDA allocator peak above start {format_bytes(tracker.device_peak_bytes)}"
                )
            status = "within budget" if tracker.peak_bytes <= plan.budget_bytes else "OVER BUDGET"
            for r in range(world):  # print in rank order
                if r == rank:
                    print(f"{line}: {status}", flush=True)
                dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
