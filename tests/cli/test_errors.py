"""Every bad input exits 2 with exactly one line on stderr, and --debug adds the traceback.

Most paths run in-process through ``gradckpt.cli.main`` (what the console script
calls; a subprocess costs a torch import each); a few run as real processes.
"""

from __future__ import annotations

import pytest

from gradckpt.cli import main

from .conftest import assert_one_line_error, gradckpt_cli

BAD = [
    (["plan", "no-such-model", "--budget", "0.5"], ["unknown target", "tiny-gpt"]),
    (["plan", "no_such_module:make", "--budget", "0.5"], ["cannot import module"]),
    (["plan", "gradckpt.testing:nope", "--budget", "0.5"], ["has no function 'nope'"]),
    (["plan", "gradckpt.testing:Example", "--budget", "0.5"], ["raised TypeError"]),
    (["plan", "missing_file.py", "--budget", "0.5"], ["does not exist"]),
    (["plan", "tiny-gpt", "--budget", "lots"], ["bad budget 'lots'"]),
    (["plan", "tiny-gpt", "--budget", "1.5"], ["bad budget '1.5'", "fraction"]),
    (["plan", "tiny-gpt", "--budget", "150%"], ["bad budget '150%'"]),
    (["plan", "tiny-gpt", "--budget", "0"], ["bad budget '0'"]),
    (["plan", "tiny-gpt"], ["--budget"]),
    (["plan", "llama-1b", "--budget", "0.5"], ["--fake"]),
    (["plan", "tiny-gpt", "--budget", "0.5", "--device", "nonsense"], ["not a device"]),
    (["explain", "tiny-gpt", "--plan", "p.json", "--budget", "0.5"], ["not both"]),
    (["explain", "tiny-gpt", "--plan", "no-such-plan.json"], ["cannot read the plan"]),
    (["bench", "--only", "nope"], ["unknown benchmark"]),
    (["bench", "--dir", "no-such-dir"], ["not a directory"]),
    (["demo", "--steps", "0"], ["--steps"]),
    (["demo", "--threads", "0"], ["--threads"]),
    (["frobnicate"], ["invalid choice"]),
]


@pytest.mark.parametrize(("args", "fragments"), BAD)
def test_bad_input_is_one_line(args, fragments, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("gradckpt: error: ")
    for fragment in fragments:
        assert fragment in err


def test_unknown_target_as_a_process():
    assert_one_line_error(gradckpt_cli("plan", "no-such-model", "--budget", "0.5"),
                          "unknown target")  # fmt: skip


def test_budget_below_the_least_feasible_peak_names_it():
    proc = gradckpt_cli("plan", "tiny-gpt", "--budget", "1MiB", "--threads", "1",
                        "--repeats", "1")  # fmt: skip
    line = assert_one_line_error(proc, "below the least feasible peak", "--budget")
    assert "bytes)" in line  # the least feasible peak, exactly


def test_missing_extra_as_a_process(tmp_path):
    proc = gradckpt_cli("plan", "gpt2-small", "--budget", "0.5", "--fake", cwd=tmp_path,
                        env={"GRADCKPT_HIDE_EXTRAS": "transformers"})  # fmt: skip
    assert_one_line_error(proc, "pip install 'gradckpt[hf]'")


def test_missing_plot_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRADCKPT_HIDE_EXTRAS", "matplotlib")
    assert main(["plan", "tiny-gpt", "--budget", "0.8", "--plot", "f.png"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["gradckpt: error: --plot needs matplotlib: pip install "
                                "'gradckpt[plot]'"]  # fmt: skip


def test_debug_shows_the_traceback(capsys):
    assert main(["plan", "no-such-model", "--budget", "0.5", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("gradckpt: error: unknown target")
