"""CLI input errors exit 2 with one line, are found before profiling, and --json gives JSON."""

from __future__ import annotations

import json

import pytest

from gradckpt.cli import main

TARGET = """
import pathlib
from gradckpt.testing import make

def make_counted():
    ex = make("mlp", blocks=2, width=16, hidden=32, batch=4)
    def loss_fn():
        pathlib.Path(__file__).with_name("profiled").touch()
        return ex.loss_fn()
    return ex.model, loss_fn

def make_raising():
    raise RuntimeError("no data here")

def make_exiting():
    raise SystemExit(3)

def make_bad_loss():
    ex = make("mlp", blocks=2, width=16, hidden=32, batch=4)
    def loss_fn():
        raise KeyError("input_ids")
    return ex.model, loss_fn
"""


@pytest.fixture
def target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(TARGET)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit('usage: train.py')\n")
    return tmp_path


BAD = {
    "--out is a directory": (["--out", "a_dir"], ["--out", "directory"]),
    "--out under a file": (["--out", "a_file/plan.json"], ["--out", "a_file"]),
    "--plot under a file": (["--plot", "a_file/f.png"], ["--plot", "a_file"]),
    "--repeats 0": (["--repeats", "0"], ["--repeats"]),
    "--budget 1e9": (["--budget", "1e9"], ["bad budget '1e9'", "whole bytes"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_cli_input_error_is_one_line_exit_2_before_profiling(target, case, capsys):
    extra, fragments = BAD[case]
    args = ["plan", "t.py:make_counted", "--budget", "0.9", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("gradckpt: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert not (target / "profiled").exists()  # refused before the step ran


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [("t.py:make_raising", ["RuntimeError", "no data here"]),
     ("t.py:make_exiting", ["SystemExit", "3"]),
     ("exits_on_import.py", ["SystemExit", "usage: train.py"]),
     ("t.py:make_bad_loss", ["loss_fn", "KeyError"])],
)  # fmt: skip
def test_target_that_raises_or_exits_is_one_line_exit_2(target, spec, fragments, capsys):
    assert main(["plan", spec, "--budget", "0.9", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("gradckpt: error: "), err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("command", ["plan", "explain"])
def test_json_errors_are_json(target, command, capsys):
    assert main([command, "no-such-model", "--budget", "0.5", "--json"]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)
    assert error["kind"] == "gradckpt.Error" and error["exit_code"] == 2
    assert "unknown target" in error["error"]
    assert len(captured.err.splitlines()) == 1
