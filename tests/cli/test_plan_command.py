"""``gradckpt plan``: built-in, module:function and file targets; JSON the library loads; --fake."""

from __future__ import annotations

import json
import textwrap

import pytest

import gradckpt

from .conftest import assert_ok, gradckpt_cli


def test_plan_builtin_writes_a_plan_the_library_loads(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "plan.json", tmp_path / "frontier.png"
    proc = gradckpt_cli(
        "plan", "tiny-gpt", "--budget", "0.8", "--out", str(out), "--plot", str(png),
        "--threads", "1", "--repeats", "1",
    )  # fmt: skip
    assert_ok(proc)
    plan = gradckpt.Plan.load(out)
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes <= plan.budget_bytes
    assert png.stat().st_size > 1000
    for text in ("blocks.0 (block)", "kept for backward", "recompute time", "least feasible",
                 "gradckpt.Plan.load", "gradckpt.apply(model, plan)"):  # fmt: skip
        assert text in proc.stdout
    # The plan applies to the same model, built the same way.
    from gradckpt.cli.targets import BUILTINS

    model, _ = BUILTINS["tiny-gpt"].build(False, "cpu")
    gradckpt.apply(model, plan)
    assert gradckpt.applied_plan(model) == plan


def test_plan_module_function_target_json(tmp_path):
    out = tmp_path / "p.json"
    proc = gradckpt_cli(
        "plan", "gradckpt.testing:gpt", "--budget", "90%", "--out", str(out), "--json",
        "--threads", "1", "--repeats", "1",
    )  # fmt: skip
    assert_ok(proc)
    data = json.loads(proc.stdout)  # --json: stdout is one JSON document
    assert data["target"] == "gradckpt.testing:gpt"
    assert data["predicted_peak_bytes"] <= data["budget_bytes"]
    assert gradckpt.Plan.from_json(data["plan"]) == gradckpt.Plan.load(out)
    assert {u["path"] for u in data["units"]} >= {"blocks.0", "lm_head"}


def test_plan_file_target(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        def make():
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(),
                                                  nn.Linear(256, 64)) for _ in range(4)])
            return model, lambda: model(torch.randn(128, 64)).square().mean()
    """)
    )
    proc = gradckpt_cli(
        "plan", "mymodel.py", "--budget", "0.85", "--out", "plan.json", "--threads", "1",
        "--repeats", "1", cwd=tmp_path,
    )  # fmt: skip
    assert_ok(proc)
    assert gradckpt.Plan.load(tmp_path / "plan.json").units[0].path == "0"


def test_plan_llama_1b_fake_allocates_nothing(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "llama.json"
    proc = gradckpt_cli(
        "plan", "llama-1b", "--fake", "--budget", "12GiB", "--out", str(out), "--json",
        "--threads", "1",
    )  # fmt: skip
    assert_ok(proc)
    data = json.loads(proc.stdout)
    assert data["profile"]["fake"] is True
    assert data["profile"]["param_bytes"] > 4 * 10**9  # 1.24B float32 parameters...
    assert data["predicted_peak_bytes"] <= 12 * 2**30
    assert len(data["profile"]["blocks"]) == 16
    assert gradckpt.Plan.load(out).budget_bytes == 12 * 2**30


_TINY_LLAMA = """
import torch
import transformers

def make():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(input_ids=ids, labels=ids).loss
"""


def test_plan_fake_goes_through_the_transformers_adapter(tmp_path):
    # The CLI profiles through the same path as gradckpt.profile, so the
    # transformers adapter's fake-tensor fix (no packed-sequence mask) applies:
    # without it this Llama's fake peak is ~3% above the real one (full mask).
    pytest.importorskip("transformers")
    (tmp_path / "tinyllama.py").write_text(_TINY_LLAMA)
    proc = gradckpt_cli(
        "plan", "tinyllama.py", "--fake", "--budget", "0.9", "--out", "plan.json", "--json",
        "--threads", "1", cwd=tmp_path,
    )  # fmt: skip
    assert_ok(proc)
    fake_peak = json.loads(proc.stdout)["profile"]["plain_peak_bytes"]
    namespace: dict = {}
    exec(_TINY_LLAMA, namespace)
    model, loss_fn = namespace["make"]()
    real_peak = gradckpt.profile(model, loss_fn, repeats=1).measured_peak_bytes
    assert abs(fake_peak - real_peak) <= 0.01 * real_peak
