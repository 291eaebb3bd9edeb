"""Layers point one way: no module of gradckpt imports a layer above its own.

Every ``import``/``from ... import`` in every module is read from its source
(AST, so imports inside functions and ``TYPE_CHECKING`` blocks count too) and
checked against the order in DESIGN.md and docs/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gradckpt"

# Lowest first. A module may import its own layer and the ones before it.
LAYERS = (
    "support",  # gradckpt.testing.*, gradckpt._versioned: nothing of gradckpt outside themselves
    "engine",
    "policies",
    "measure",
    "profile",
    "plan",
    "apply",
    "compiled",  # gradckpt.compiled.*: plans under torch.compile; fit(compile=True) calls it
    "api",  # the verbs (profile/plan/fit/frontier/explain); model families only via adapters
    "integrations",  # adapters register below; trainer callbacks, FSDP/DDP build on api
    "package",  # gradckpt/__init__.py: re-exports every layer's public names
    "cli",
)
# Module name (or a prefix ending with ".") -> layer. The first match wins.
_WHERE = (
    ("gradckpt.testing.", "support"),
    ("gradckpt.testing", "support"),
    ("gradckpt._versioned", "support"),
    ("gradckpt.engine.", "engine"),
    ("gradckpt.engine", "engine"),
    ("gradckpt.policies", "policies"),
    ("gradckpt.measure.", "measure"),
    ("gradckpt.measure", "measure"),
    ("gradckpt.profiling.", "profile"),
    ("gradckpt.profiling", "profile"),
    ("gradckpt.planning.", "plan"),
    ("gradckpt.planning", "plan"),
    ("gradckpt.replan", "plan"),
    ("gradckpt.apply.", "apply"),
    ("gradckpt.apply", "apply"),
    ("gradckpt.compiled.", "compiled"),
    ("gradckpt.compiled", "compiled"),
    ("gradckpt.api_shapes", "api"),
    ("gradckpt.api_budget", "api"),
    ("gradckpt.api_checks", "api"),
    ("gradckpt.tuning.", "api"),
    ("gradckpt.tuning", "api"),
    ("gradckpt.api", "api"),
    ("gradckpt.integrations.", "integrations"),
    ("gradckpt.integrations", "integrations"),
    ("gradckpt.cli.", "cli"),
    ("gradckpt.cli", "cli"),
    ("gradckpt.__main__", "cli"),
)
TOP = "gradckpt"


def layer_of(module: str) -> str:
    """The layer of a gradckpt module name."""
    if module == TOP:
        return "package"
    for prefix, layer in _WHERE:
        if module == prefix or (prefix.endswith(".") and module.startswith(prefix)):
            return layer
    raise AssertionError(
        f"{module} is in no layer: add it to tests/test_layers.py and docs/architecture.md"
    )


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported gradckpt module) for every import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == TOP]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != TOP:
                continue
            if node.module == TOP:  # from gradckpt import plan, __version__
                found += [(node.lineno, _submodule_or_top(a.name)) for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def _submodule_or_top(name: str) -> str:
    is_module = (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()
    return f"{TOP}.{name}" if is_module else TOP


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: _module_name(p))
def test_no_module_imports_a_layer_above_its_own(path):
    here = layer_of(_module_name(path))
    upward = []
    for line, target in imports_of(path):
        assert not target.startswith("."), f"{path}:{line}: relative import; write gradckpt.…"
        there = layer_of(target)
        if LAYERS.index(there) > LAYERS.index(here):
            upward.append(f"{path.name}:{line} ({here}) imports {target} ({there})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    # The walker must see imports inside functions, as a lower layer's lazy
    # import of an upper one would be written.
    source = tmp_path / "sample.py"
    source.write_text(
        "def f():\n    from gradckpt.api import plan\n    import gradckpt.cli\n"
        "from gradckpt import measure\n"
    )
    assert imports_of(source) == [(4, "gradckpt.measure"), (2, "gradckpt.api"),
                                  (3, "gradckpt.cli")] or sorted(imports_of(source)) == [
        (2, "gradckpt.api"), (3, "gradckpt.cli"), (4, "gradckpt.measure")]  # fmt: skip
    assert LAYERS.index(layer_of("gradckpt.api")) > LAYERS.index(layer_of("gradckpt.planning.dp"))
