"""Plan, apply, then torch.compile: compiled region bodies, the plain model's gradients.

    python examples/compile_train.py                      # aot_eager on CPU
    python examples/compile_train.py --backend inductor   # needs a C++ compiler on CPU

The order is plan/apply, then compile (then FSDP, see examples/fsdp_train.py).
``compile_model`` compiles each unit's body and runs it inside its region: the
region's forward and its recompute run the same compiled code. The script
checks the first step's gradients against the plain eager model (same seed,
dropout on), then times eager-planned and compiled-planned steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradckpt
from gradckpt.compiled.around_regions import compile_model, compiled_units
from gradckpt.testing import gpt


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend", default="inductor" if torch.cuda.is_available() else "aot_eager"
    )
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of the plain peak")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    return parser.parse_args()  # fmt: skip


def _grads(example, seed: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    example.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = example.loss_fn()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in example.model.named_parameters()}
    example.model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _step_times(example, steps: int) -> list[float]:
    times = []
    for step in range(steps):
        torch.manual_seed(step)
        start = time.perf_counter()
        example.loss_fn().backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        example.model.zero_grad(set_to_none=True)
    return times


def main() -> None:
    args = _args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    example = gpt(layers=args.layers, d_model=args.d_model, seq=args.seq, batch=args.batch,
                  device=device)  # fmt: skip
    plain_loss, plain = _grads(example)

    plan = gradckpt.fit(example.model, example.loss_fn, args.budget)  # 1. plan + apply
    print(plan.summary())
    eager = statistics.median(_step_times(example, args.steps))

    compile_model(example.model, backend=args.backend)  # 2. compile (3. FSDP would follow)
    start = time.perf_counter()
    loss, grads = _grads(example)
    first = time.perf_counter() - start
    worst = max((grads[k] - plain[k]).abs().max().item() for k in plain)
    print(f"compiled unit bodies: {', '.join(compiled_units(example.model))}")
    print(f"first compiled step (compiles): {first:.1f} s")
    print(f"loss plain {plain_loss:.6f}, compiled+planned {loss:.6f}; "
          f"largest gradient difference {worst:.2e}")  # fmt: skip
    compiled = statistics.median(_step_times(example, args.steps))
    print(f"median step: planned eager {eager * 1e3:.1f} ms, planned compiled "
          f"({args.backend}) {compiled * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
