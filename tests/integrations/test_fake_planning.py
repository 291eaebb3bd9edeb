"""Planning without running: fake-tensor profiles of transformers models."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.measure import MemoryTracker

transformers = pytest.importorskip("transformers")


def _llama(layers, hidden, heads, kv, vocab, inter, device=None):
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        max_position_embeddings=512, use_cache=False,
    )  # fmt: skip
    if device == "meta":
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config), config
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config), config


def test_fake_prediction_matches_the_real_step_within_5_percent():
    model, config = _llama(layers=3, hidden=64, heads=4, kv=2, vocab=1000, inter=176)
    ids = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))

    def loss_fn():
        return model(input_ids=ids, labels=ids).loss

    fake = gradckpt.profile(model, loss_fn, fake=True)
    real = gradckpt.profile(model, loss_fn, repeats=1)
    assert (
        abs(fake.measured_peak_bytes - real.measured_peak_bytes) <= 0.05 * real.measured_peak_bytes
    )
    for fraction in (0.75, 0.9):
        plan = gradckpt.plan(model, loss_fn, fraction, profiling=gradckpt.ProfileOptions(profile=fake))
        gradckpt.apply(model, plan)
        try:
            with MemoryTracker(model) as tracker:
                loss_fn().backward()
        finally:
            gradckpt.remove(model)
            model.zero_grad(set_to_none=True)
        assert abs(plan.predicted_peak_bytes - tracker.peak_bytes) <= 0.05 * tracker.peak_bytes
        assert tracker.peak_bytes <= plan.budget_bytes * 1.05


def test_llama_8b_shape_is_planned_without_allocating_it():
    """32 layers, hidden 4096, batch 1, sequence 4096: ~30 GiB of fp32 weights, never allocated."""
    model, config = _llama(
        layers=32, hidden=4096, heads=32, kv=8, vocab=128256, inter=14336, device="meta"
    )

    def loss_fn():
        ids = torch.randint(0, config.vocab_size, (1, 4096))
        return model(input_ids=ids, labels=ids).loss

    prof = gradckpt.profile(model, loss_fn, fake=True)
    assert prof.fake and len(prof.blocks) == 32
    assert prof.param_bytes > 28 * 2**30 and prof.measured_peak_bytes > prof.param_bytes
    plan = gradckpt.plan(model, loss_fn, "60GiB", profiling=gradckpt.ProfileOptions(profile=prof))
    assert plan.predicted_peak_bytes <= 60 * 2**30
    kept = [u for u in plan.units if u.mode == "selective"]
    assert all(u.save_ops for u in kept)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_fake_cuda_without_cuda_is_refused_not_crashed():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="needs a torch build with cuda"):
        gradckpt.profile(model, lambda: model(torch.randn(2, 4)).sum(), fake=True, device="cuda")
