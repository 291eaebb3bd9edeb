"""``gradckpt estimate|plan TARGET --stages N``: per-stage plans of a pipeline, under fake tensors.

In-process (``main``): a Llama-3-8B shape on 4 stages under 1F1B (built on the meta
device, nothing allocated), and the flags' refusals, which come before any planning.
"""

from __future__ import annotations

import json

import pytest

from gradckpt.cli import main
from gradckpt.integrations.pipeline_report import StagePlan


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_llama3_8b_on_4_stages_prints_the_per_stage_table(capsys, tmp_path):
    out_path = tmp_path / "stages.json"
    code, out, err = run(capsys, "plan", "llama3-8b", "--stages", "4", "--schedule", "1f1b",
                         "--microbatches", "8", "--optimizer", "adamw", "--budget", "60GiB",
                         "--out", str(out_path))  # fmt: skip
    assert code == 0, err
    assert "pipeline: 4 stages, 1f1b, 8 micro-batches, budget 60.00 GiB per rank" in out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert [int(r[1]) for r in rows] == [4, 3, 2, 1]  # 1F1B: P - s in flight
    plans = [StagePlan.from_json(d) for d in json.loads(out_path.read_text())]
    assert all(p.fake and p.predicted_peak_bytes <= 60 * 2**30 for p in plans)
    # 8B in bf16 with AdamW is ~64 GB of parameters, gradients and state: ~16 GB a stage.
    assert all(p.plain_peak_bytes > 14e9 for p in plans)
    assert plans[0].plain_peak_bytes > 60 * 2**30  # stage 0 needs recompute here ...
    assert plans[0].time_per_microbatch > plans[0].plain_time_per_microbatch
    assert plans[2].describe() == "keep all"  # ... stage 2, with 2 in flight, does not


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["estimate", "gpt2-small", "--stages", "2"], "built-in decoder"),
        (["estimate", "tiny-gpt", "--stages", "1"], "at least 2"),
        (["estimate", "tiny-gpt", "--stages", "2", "--schedule", "interleaved1f1b"],
         "virtual stages"),
        (["estimate", "tiny-gpt", "--stages", "4", "--microbatches", "2"], "at least as many"),
        (["estimate", "tiny-gpt", "--stages", "2", "--budget", "0.5"], "bytes per rank"),
        (["plan", "tiny-gpt", "--stages", "2", "--budget", "least"], "bytes per rank"),
    ],
)  # fmt: skip
def test_pipeline_flags_are_refused_in_one_line(capsys, args, fragment):
    code, _, err = run(capsys, *args)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradckpt: error: ") and fragment in lines[0], (
        err
    )
