"""Plan a Llama-3-8B-sized training step on a machine that could never run it.

The model is built on the meta device and profiled under fake tensors: nothing
is allocated, so this runs on a laptop CPU in well under two minutes. For each
budget it prints the predicted peak and overhead, and which ops each layer
keeps (the rest is recomputed in backward).

    python examples/plan_llama8b.py --seq 4096 --budgets 80GiB 60GiB 40GiB
"""

from __future__ import annotations

import argparse
import time

import torch

import gradckpt


def build(layers: int, seq: int, batch: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)

    def loss_fn() -> torch.Tensor:
        # Inputs are made inside loss_fn, so they are fake tensors too.
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        return model(input_ids=ids, labels=ids).loss

    return model, loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (8B: 32)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="parameter dtype (bfloat16 halves weights and activations)")  # fmt: skip
    parser.add_argument("--budgets", nargs="+", default=["80GiB", "60GiB", "40GiB"],
                        help="budgets to plan for (bytes, '60GiB', or a fraction)")  # fmt: skip
    args = parser.parse_args()
    model, loss_fn = build(args.layers, args.seq, args.batch, getattr(torch, args.dtype))
    start = time.perf_counter()
    prof = gradckpt.profile(model, loss_fn, fake=True)
    print(f"profiled under fake tensors in {time.perf_counter() - start:.1f} s: plain peak "
          f"{prof.measured_peak_bytes / 2**30:.1f} GiB (weights {prof.param_bytes / 2**30:.1f} GiB)")  # fmt: skip
    for budget in args.budgets:
        start = time.perf_counter()
        try:
            plan = gradckpt.plan(model, loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof))
        except gradckpt.BudgetError as error:
            print(f"\n{budget}: {error}")
            continue
        print(f"\n{budget}: planned in {time.perf_counter() - start:.1f} s")
        print(plan.summary())


if __name__ == "__main__":
    main()
