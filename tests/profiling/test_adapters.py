"""The adapter registry: model families prepare, name blocks and switch training through it."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.profiling import adapters
from gradckpt.profiling.adapters import Adapter, register_adapter


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class FamilyModel(nn.Module):
    """A model of an imaginary family whose ``cache`` keeps an extra activation alive."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.cache = True
        self.cached: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.stack:
            x = layer(x)
            if self.cache:
                self.cached.append(x.repeat(1, 8))  # a KV-cache-like copy, live to the end
        out = self.head(x).sum()
        self.cached.clear()
        return out


def _is_family(model: nn.Module) -> bool:
    return isinstance(model, FamilyModel)


@contextlib.contextmanager
def _no_cache(model: FamilyModel):
    before, model.cache = model.cache, False
    try:
        yield
    finally:
        model.cache = before


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test."""
    monkeypatch.setattr(adapters, "_ADAPTERS", dict(adapters._ADAPTERS))
    return adapters._ADAPTERS


def _step(model):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    return lambda: model(x)


def test_profiling_enters_the_adapters_preparation_and_leaves_it(registry):
    model = FamilyModel()
    plain = gradckpt.profile(model, _step(model), repeats=1)
    register_adapter(Adapter("family", recognizes=_is_family, prepare=_no_cache))
    prepared = gradckpt.profile(model, _step(model), repeats=1)
    assert prepared.measured_peak_bytes < plain.measured_peak_bytes  # the cached copies are gone
    assert model.cache is True  # put back
    # The raw profiler is the same path: nothing bypasses the registry.
    raw = gradckpt.profiling.profile(model, _step(model), repeats=1)
    assert raw.measured_peak_bytes == prepared.measured_peak_bytes


def test_fake_inputs_hook_is_entered_only_under_fake_tensors(registry):
    entered = []

    @contextlib.contextmanager
    def note(model):
        entered.append(model)
        yield

    register_adapter(Adapter("family", recognizes=_is_family, fake_inputs=note))
    model = FamilyModel()
    gradckpt.profile(model, _step(model), repeats=1)
    assert entered == []
    gradckpt.profile(model, _step(model), fake=True)
    assert entered == [model]


def test_an_adapters_blocks_win_over_the_generic_rules(registry):
    model = FamilyModel()
    assert gradckpt.profiling.find_blocks(model) == ["stack.0", "stack.1", "stack.2"]
    register_adapter(Adapter("family", recognizes=_is_family,
                             find_blocks=lambda m: ["stack.0", "stack.2"]))  # fmt: skip
    assert gradckpt.profiling.find_blocks(model) == ["stack.0", "stack.2"]
    assert gradckpt.profiling.find_blocks(nn.Sequential(Layer(), Layer())) == ["0", "1"]


def test_fit_keeps_the_training_switches(registry):
    @contextlib.contextmanager
    def cache_off_for_good(model):
        model.cache = False
        yield

    register_adapter(Adapter("family", recognizes=_is_family, training=cache_off_for_good))
    model = FamilyModel()
    gradckpt.fit(model, _step(model), 1.0, measure_candidates=0, profiling=gradckpt.ProfileOptions(repeats=1))
    assert model.cache is False
    gradckpt.remove(model)


def test_a_failing_preparation_leaves_nothing_half_prepared(registry):
    def broken(model):
        raise RuntimeError("cannot prepare")

    register_adapter(Adapter("family", recognizes=_is_family, prepare=_no_cache))
    register_adapter(Adapter("family-broken", recognizes=_is_family, prepare=broken))
    model = FamilyModel()
    with pytest.raises(RuntimeError, match="cannot prepare"):
        gradckpt.profile(model, _step(model), repeats=1)
    assert model.cache is True


def test_register_adapter_refuses_what_is_not_an_adapter(registry):
    with pytest.raises(TypeError, match="Adapter"):
        register_adapter({"name": "family"})


def test_import_registers_the_built_in_adapters_without_their_libraries():
    code = (
        "import sys, gradckpt; from gradckpt.profiling.adapters import _ADAPTERS; "
        "print(sorted(_ADAPTERS), 'transformers' in sys.modules, 'diffusers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['diffusers', 'shape guard', 'transformers'] False False"
