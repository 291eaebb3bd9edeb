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
    ("gradckpt.apply.", "apply"),
    ("gradckpt.apply", "apply"),
    ("gradckpt.compiled.", "compiled"),
    ("gradckpt.compiled", "compiled"),
    ("gradckpt.api.", "api"),
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


def _planted(tmp_path: Path, source: str) -> Path:
    """A module of ``source`` beside the test, for the import walkers to read."""
    path = tmp_path / "sample.py"
    path.write_text(source)
    return path


def test_the_check_sees_an_upward_import(tmp_path):
    # The walker must see imports inside functions, as a lower layer's lazy
    # import of an upper one would be written.
    source = _planted(
        tmp_path,
        "def f():\n    from gradckpt.api import plan\n    import gradckpt.cli\n"
        "from gradckpt import measure\n",
    )
    assert imports_of(source) == [(4, "gradckpt.measure"), (2, "gradckpt.api"),
                                  (3, "gradckpt.cli")] or sorted(imports_of(source)) == [
        (2, "gradckpt.api"), (3, "gradckpt.cli"), (4, "gradckpt.measure")]  # fmt: skip
    planning = layer_of("gradckpt.planning.solving.dp")
    assert LAYERS.index(layer_of("gradckpt.api")) > LAYERS.index(planning)


# ------------------------------------------------------------ inside the planning layer

PLANNING = "gradckpt.planning"
# Parts of gradckpt/planning, lowest first: a planning module may import its own
# part and the ones before it. The kinds sit above the simulator and the solvers
# (which reach them only through the registry in ``handlers``); "package" is
# gradckpt/planning's own modules (__init__, which loads the kinds; solve; planner).
PLANNING_PARTS = ("handlers", "plans", "simulation", "solving", "kinds", "explaining", "package")


def planning_part(module: str) -> str:
    """The part of gradckpt.planning that ``module`` (a gradckpt.planning module) is in."""
    head = module[len(PLANNING) + 1 :].split(".")[0] if module != PLANNING else ""
    if not head or not (PACKAGE / "planning" / head / "__init__.py").is_file():
        return "package"  # gradckpt.planning itself, or a module directly in it
    assert head in PLANNING_PARTS, (
        f"gradckpt/planning/{head}/ is in no part: add it to PLANNING_PARTS in "
        "tests/test_layers.py and to docs/architecture.md"
    )
    return head


def _in_planning(module: str) -> bool:
    return module == PLANNING or module.startswith(PLANNING + ".")


def upward_planning_imports(path: Path, module: str) -> list[str]:
    """Imports in ``path`` (the source of ``module``) of a planning part above its own."""
    here = planning_part(module)
    return [
        f"{path.name}:{line} ({here}) imports {target} ({planning_part(target)})"
        for line, target in imports_of(path)
        if _in_planning(target)
        and PLANNING_PARTS.index(planning_part(target)) > PLANNING_PARTS.index(here)
    ]


def _planning_sources() -> list[Path]:
    return sorted((PACKAGE / "planning").rglob("*.py"))


@pytest.mark.parametrize("path", _planning_sources(), ids=lambda p: _module_name(p))
def test_no_planning_module_imports_a_part_above_its_own(path):
    upward = upward_planning_imports(path, _module_name(path))
    assert not upward, "upward imports inside gradckpt.planning:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import_between_planning_parts(tmp_path):
    # A lazy import, and one for type checking only, as a circle is usually hidden.
    source = _planted(
        tmp_path,
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gradckpt.planning.kinds.keep import KeepHandler\n"
        "def f():\n    from gradckpt.planning.solving.chain import build_chain\n",
    )
    assert len(upward_planning_imports(source, "gradckpt.planning.simulation.simulate")) == 2
    assert upward_planning_imports(source, "gradckpt.planning.solving.chain") != []  # kinds
    assert upward_planning_imports(source, "gradckpt.planning.explaining.explain") == []
    assert planning_part("gradckpt.planning.kinds.offload.sim") == "kinds"
    assert planning_part("gradckpt.planning.solve") == planning_part(PLANNING) == "package"


def planning_graph() -> dict[str, set[str]]:
    """Module -> the planning modules it imports (inside functions and for type checking too)."""
    return module_graph(_planning_sources(), runtime_only=False)


def module_graph(sources: list[Path], runtime_only: bool) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports (inside functions too).

    ``from a.b import c`` imports module ``a.b.c`` when there is one, else ``a.b``.
    A module's parent packages run before it whatever it imports, so they are not
    edges unless it imports them by name (``gradckpt.planning`` imports the kinds,
    and every module is under it). ``runtime_only``: imports under
    ``if TYPE_CHECKING:`` never run, so they are left out.
    """
    modules = {_module_name(p): p for p in sources}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in _runtime_imports(tree) if runtime_only else ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                found.update([s for s in subs if s in modules] or [node.module])
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The imports of ``tree`` that can run: all but those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:  # the else branch does run
                    visit_one(other)
            else:
                visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        visit(node)

    visit(tree)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_inside_planning():
    graph = planning_graph()
    assert "gradckpt.planning.solving.dp_chain" in graph["gradckpt.planning.solving.dp"]
    assert import_circles(graph) == []


def test_the_circle_check_sees_a_circle():
    graph = planning_graph()
    graph["gradckpt.planning.handlers.registry"].add("gradckpt.planning.kinds")  # a lazy load
    circles = import_circles(graph)
    assert len(circles) == 1 and "gradckpt.planning.kinds.keep" in circles[0]


# ------------------------------------------------------------ the whole package

# [#44] A lazy import that exists to dodge a circle is a circle: the graph of every
# module's imports that can run (function-level ones included) has none.


def test_no_import_circle_anywhere_in_gradckpt():
    graph = module_graph(_sources(), runtime_only=True)
    assert "gradckpt.apply.guard" in graph["gradckpt.apply.wrappers"]
    assert import_circles(graph) == []


def test_the_package_circle_check_sees_lazy_imports_but_not_type_checking_ones(tmp_path):
    source = _planted(
        tmp_path,
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import gradckpt.cli\n"
        "else:\n    import gradckpt.measure\n"
        "def f():\n    from gradckpt.api import plan\n",
    )
    runtime = [node.lineno for node in _runtime_imports(ast.parse(source.read_text()))]
    assert runtime == [1, 5, 7]
    graph = module_graph(_sources(), runtime_only=True)
    graph["gradckpt.apply.guard_routing"].add("gradckpt.apply.apply")  # install_plan, lazily
    circles = import_circles(graph)
    assert len(circles) == 1 and "gradckpt.apply.wrappers" in circles[0]
