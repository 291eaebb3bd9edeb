"""``--no-chunking`` and the chunk decisions the CLI lists (issue #41).

In-process (``main``) on a small GPT whose vocabulary makes the loss's backward
the floor of every plan that does not chunk, estimated under fake tensors.
"""

from __future__ import annotations

import contextlib
import io
import json
import textwrap

import pytest

from gradckpt.cli import main

TARGET = textwrap.dedent(
    """
    import torch
    from gradckpt.testing import make

    def make_target():
        ex = make("gpt", layers=2, d_model=32, heads=2, seq=64, vocab=8192, batch=4)
        return ex.model, ex.loss_fn
    """
)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chunk") / "big_vocab.py"
    path.write_text(TARGET)
    return f"{path}:make_target"


def _estimate(*args: str) -> dict:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["estimate", *args, "--budget", "least", "--json"]) == 0
    return json.loads(buffer.getvalue())


def test_estimate_lists_the_chunked_head_and_no_chunking_forbids_it(target, capsys):
    chunked = _estimate(target)
    plain = _estimate(target, "--no-chunking")
    assert chunked["leanest"]["chunked"] == [
        {"path": "lm_head", "chunks": chunked["leanest"]["chunked"][0]["chunks"]}
    ]
    assert plain["leanest"]["chunked"] == []
    assert chunked["leanest"]["total_bytes"] < 0.85 * plain["leanest"]["total_bytes"]
    assert main(["estimate", target, "--budget", "least"]) == 0
    out = capsys.readouterr().out
    assert "leanest plan chunks: lm_head and the loss after it run in" in out
    assert "exact up to the order of sums" in out


def test_plan_and_explain_take_no_chunking(target, tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    args = ["plan", target, "--fake", "--repeats", "1", "--budget", "least", "--out"]
    assert main([*args, str(out_path)]) == 0
    assert any(i.get("mode") == "chunk" for i in json.loads(out_path.read_text())["items"])
    assert main([*args, str(out_path), "--no-chunking"]) == 0
    saved = json.loads(out_path.read_text())
    assert saved["version"] == 1 and not any(i.get("mode") == "chunk" for i in saved["items"])
    capsys.readouterr()
    assert main(["explain", target, "--fake", "--repeats", "1", "--budget", "least",
                 "--units"]) == 0  # fmt: skip
    assert "chunk (" in capsys.readouterr().out
