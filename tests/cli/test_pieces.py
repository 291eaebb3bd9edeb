"""The CLI's pieces in-process: budget strings, targets, plain tables, the lean import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from torch import nn

from gradckpt.cli.common import budget_arg, budget_at_least
from gradckpt.cli.extras import CliError, optional, require
from gradckpt.cli.output import plain_table
from gradckpt.cli.targets import BUILTINS, resolve
from gradckpt.planning.solving.budget import parse_budget

from .conftest import ROOT


@pytest.mark.parametrize(
    ("text", "value"),
    [("0.5", 0.5), ("50%", 0.5), (".25", 0.25), ("1", 1), ("4096", 4096), ("800MB", "800MB"),
     ("1.5GiB", "1.5GiB"), ("12 GB", "12 GB"), ("least", "least"), ("1.0", 1.0)],
)  # fmt: skip
def test_budget_arg(text, value):
    assert budget_arg(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1.5", "0.0", "-3", "0%", "101%", "12 parsecs"])
def test_bad_budget_arg(text):
    with pytest.raises(CliError, match="bad budget"):
        budget_arg(text)


@pytest.mark.parametrize("nbytes", [1, 1023, 4108808, 5 * 2**30 + 1, 3 << 20])
def test_budget_at_least_rounds_up(nbytes):
    assert parse_budget(budget_at_least(nbytes), 0) >= nbytes


def test_plain_table_aligns_columns():
    lines = plain_table(["name", "bytes"], [["a", "1 B"], ["longer", "10 KiB"]], right=(1,),
                        footer=["total", "11 KiB"])  # fmt: skip
    assert lines[0] == "name     bytes"
    assert lines[2] == "a          1 B"
    assert lines[-1] == "total   11 KiB"


def test_hidden_extras(monkeypatch):
    monkeypatch.setenv("GRADCKPT_HIDE_EXTRAS", "json")
    assert optional("json") is None
    with pytest.raises(CliError, match=r"needs json"):
        require("json", "the thing")


def test_file_targets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        from gradckpt.testing import make
        def target():
            m = nn.Linear(2, 2)
            return m, lambda: m(torch.ones(1, 2)).sum()
        def example():
            return make("mlp", blocks=2)
        def wrong():
            return 3
    """)
    )
    assert isinstance(resolve("t.py").model, nn.Linear)  # finds target()
    assert resolve("t.py:example").model.head.out_features == 10  # an Example works too
    with pytest.raises(CliError, match="must return \\(model, loss_fn\\)"):
        resolve("t.py:wrong")
    with pytest.raises(CliError, match="has no function"):
        resolve("t.py:nope")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(CliError, match="neither make\\(\\) nor target\\(\\)"):
        resolve("empty.py")


def test_module_targets_find_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (tmp_path / "cwd_target_mod.py").write_text(
        "from gradckpt.testing import make\ndef make_it():\n    return make('mlp', blocks=2)\n"
    )
    assert resolve("cwd_target_mod:make_it").name == "cwd_target_mod:make_it"


def test_hf_builtins_build_on_meta_when_fake():
    pytest.importorskip("transformers")
    model, _ = BUILTINS["gpt2-small"].build(True, "cpu")
    assert all(p.is_meta for p in model.parameters())


def test_import_gradckpt_stays_light():
    code = (
        "import sys, gradckpt, gradckpt.cli, gradckpt.planning.explaining.explain; "
        "print(sorted(m for m in ('rich', 'matplotlib', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stderr
