"""Every command answers --help (exit 0, its usage and flags); no command prints usage and exits 2."""

from __future__ import annotations

import pytest

from gradckpt.cli import main

from .conftest import assert_ok, gradckpt_cli


def test_top_level_help_lists_the_commands():
    proc = gradckpt_cli("--help")
    assert_ok(proc)
    for command in ("demo", "estimate", "plan", "explain", "bench"):
        assert command in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("demo", ["--budget", "--steps", "--out"]),
        ("estimate", ["--optimizer", "--accumulation", "--zero-grads", "--budget", "--json"]),
        ("plan", ["--budget", "--out", "--plot", "--fake", "--blocks", "--json"]),
        ("plan", ["--optimizer", "--accumulation", "--zero-grads"]),
        ("explain", ["--budget", "--plan", "--json", "--fake"]),
        ("bench", ["--quick", "--out", "--only"]),
    ],
)
def test_command_help(command, flags, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: gradckpt {command}" in text
    for flag in flags:
        assert flag in text


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out
