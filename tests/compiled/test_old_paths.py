"""The compiled path's old integrations paths still import for one release, with a warning.

Each old module is imported afresh (dropped from ``sys.modules`` first: a module
warns only when it is first imported) and must raise a DeprecationWarning
naming the new path, then hand out the new module's very objects.
"""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = {
    "gradckpt.integrations.compile": "gradckpt.compiled.around_regions",
    "gradckpt.integrations.compiled_budget": "gradckpt.compiled.budget",
    "gradckpt.integrations.compiled_knapsack": "gradckpt.compiled.knapsack",
}


@pytest.mark.parametrize("old, new", MOVED.items(), ids=list(MOVED))
def test_an_old_path_warns_and_gives_the_new_objects(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        shim = importlib.import_module(old)
    moved = importlib.import_module(new)
    assert shim.__all__ == moved.__all__
    for name in moved.__all__:
        assert getattr(shim, name) is getattr(moved, name), name


def test_from_imports_of_old_paths_give_public_and_private_names(monkeypatch):
    monkeypatch.delitem(sys.modules, "gradckpt.integrations.compiled_knapsack", raising=False)
    with pytest.warns(DeprecationWarning):
        from gradckpt.integrations.compiled_knapsack import SavedBytesSolver, _flops
    from gradckpt.compiled import knapsack

    assert (SavedBytesSolver, _flops) == (knapsack.SavedBytesSolver, knapsack._flops)
