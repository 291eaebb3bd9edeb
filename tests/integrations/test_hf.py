"""gradckpt on Hugging Face transformers models built from configs (random weights, no downloads).

For GPT-2, Llama, BERT, ViT and T5: which blocks are found, ``fit`` against the
plain run (same seed, dropout on: gradients equal, measured peak within budget,
prediction within 5%), multi-layer segments, ``use_cache`` handling with one
message, and transformers' own switch running gradckpt (``hf.enable``).
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import gradckpt
from gradckpt.integrations import hf
from gradckpt.integrations.hf.zoo import HF_MODELS, hf_example, run_step
from gradckpt.planning import Plan, Segment, UnitChoice, simulate
from gradckpt.profiling import model_fingerprint

# Test sizes: tiny, but with activations enough that a plan has something to save.
SIZES = {
    "gpt2": dict(layers=3),
    "llama": dict(layers=3),
    "bert": dict(layers=3),
    "vit": dict(layers=3, image=64),  # 65 tokens
    "t5": dict(layers=2),  # 2 encoder + 2 decoder blocks
}
# A budget between the least feasible peak and the plain one (fractions of plain).
BUDGETS = {"gpt2": 0.8, "llama": 0.85, "bert": 0.88, "vit": 0.75, "t5": 0.9}
LAYER_CLASSES = {
    "gpt2": "GPT2Block",
    "llama": "LlamaDecoderLayer",
    "bert": "BertLayer",
    "vit": "ViTLayer",
    "t5": "T5Block",
}
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hf_log():
    """Records of the transformers logger (its warning_once cache cleared first)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("transformers")
    handler = Keep(level=logging.WARNING)
    logger.addHandler(handler)
    once = getattr(logging.Logger, "warning_once", None)
    if once is not None and hasattr(once, "cache_clear"):
        once.cache_clear()
    yield records
    logger.removeHandler(handler)


def _checkpoint_warnings(records: list[logging.LogRecord]) -> list[str]:
    texts = [r.getMessage() for r in records]
    return [t for t in texts if "checkpointing" in t and ("cache" in t or "Caching" in t)]


def _gradckpt_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("gradckpt")]


def _hf_checkpointing(model) -> bool:
    """transformers' own switch is on (``is_activation_checkpointing`` in 5.x)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _hf_enable(model) -> None:
    """transformers' own switch, non-reentrant (``activation_checkpointing_enable`` in 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _example(name: str, **over):
    return hf_example(name, **{**SIZES[name], **over})


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0]


def _segment_plan(model, prof, inner: str = "recompute") -> Plan:
    """Each stack of blocks (GPT-2's h, T5's encoder and decoder) as one segment.

    Inside the segment every block but the last is ``inner`` during the recompute.
    """
    items: list = []
    run: list[str] = []

    def close() -> None:
        if run:
            inside = [UnitChoice(p, inner) for p in run[:-1]] + [UnitChoice(run[-1])]
            items.append(Segment(tuple(inside)))
            run.clear()

    for unit in prof.units:
        if unit.is_block:
            if run and _parent(run[-1]) != _parent(unit.path):
                close()
            run.append(unit.path)
        else:
            close()
            items.append(UnitChoice(unit.path))
    close()
    return Plan(tuple(items), model_fingerprint(model))


# --------------------------------------------------------------------------- import


def test_gradckpt_never_imports_transformers():
    code = (
        "import sys, gradckpt, gradckpt.integrations.hf, torch; "
        "from gradckpt.testing import make; ex = make('mlp'); "
        "gradckpt.fit(ex.model, ex.loss_fn, 1.0, repeats=1); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("name", HF_MODELS)
def test_layers_are_the_blocks(name):
    ex = _example(name)
    modules = dict(ex.model.named_modules())
    classes = {type(modules[p]).__name__ for p in ex.block_paths}
    expected = 2 * SIZES[name]["layers"] if name == "t5" else SIZES[name]["layers"]
    assert classes == {LAYER_CLASSES[name]} and len(ex.block_paths) == expected
    if name == "t5":  # both stacks, encoder first
        assert [p.split(".")[0] for p in ex.block_paths] == ["encoder"] * 2 + ["decoder"] * 2


# --------------------------------------------------------------------------- fit


@pytest.mark.parametrize("name", HF_MODELS)
def test_fit_matches_the_plain_run_within_budget(name):
    ex = _example(name)
    plain = run_step(ex)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the use_cache message is tested below
        plan = gradckpt.fit(ex.model, ex.loss_fn, budget=BUDGETS[name], profiling=gradckpt.ProfileOptions(repeats=1))
    # A block is checkpointed in its own region or inside a segment (fit may keep
    # a measured-faster candidate that uses one).
    in_segments = {p for i in plan.items if isinstance(i, Segment) for p in i.paths}
    checkpointed = {u.path for u in plan.units if u.mode != "keep"} | in_segments
    assert checkpointed & set(ex.block_paths), plan.summary()
    planned = run_step(ex)
    assert torch.equal(planned.loss, plain.loss)
    assert planned.max_grad_diff(plain) <= TOL
    assert planned.peak_bytes <= plan.budget_bytes < plain.peak_bytes
    assert abs(plan.predicted_peak_bytes - planned.peak_bytes) <= 0.05 * planned.peak_bytes
    gradckpt.remove(ex.model)


@pytest.mark.parametrize("name", HF_MODELS)
def test_segments_over_chained_layers(name):
    """A stack of layers as one region: tuple outputs, masks and rotary tables as kwargs,
    T5's position bias handed from layer to layer and the encoder output consumed by
    every decoder layer's cross-attention."""
    ex = _example(name)
    hf.disable_cache(ex.model)
    plain = run_step(ex)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    blocks = [u for u in prof.units if u.is_block]
    # Each layer takes the previous layer's output (tuple outputs and kwargs aside).
    stacked = [(a, b) for a, b in itertools.pairwise(blocks) if _parent(a.path) == _parent(b.path)]
    assert stacked and all(b.chained for _, b in stacked)
    peaks = {}
    for inner in ("recompute", "keep"):
        plan = _segment_plan(ex.model, prof, inner)
        assert sum(isinstance(i, Segment) for i in plan.items) == (2 if name == "t5" else 1)
        predicted = simulate(prof, plan).peak_bytes
        gradckpt.apply(ex.model, plan)
        step = run_step(ex)
        gradckpt.remove(ex.model)
        assert torch.equal(step.loss, plain.loss)
        assert step.max_grad_diff(plain) <= TOL
        assert abs(predicted - step.peak_bytes) <= 0.05 * step.peak_bytes
        peaks[inner] = step.peak_bytes
    assert peaks["recompute"] < plain.peak_bytes


# --------------------------------------------------------------------------- use_cache


def test_fit_turns_the_cache_off_with_one_message(hf_log):
    ex = _example("gpt2")
    assert ex.model.config.use_cache is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradckpt.fit(ex.model, ex.loss_fn, budget=BUDGETS["gpt2"], profiling=gradckpt.ProfileOptions(repeats=1))
        gradckpt.fit(ex.model, ex.loss_fn, budget=0.9, profiling=gradckpt.ProfileOptions(repeats=1))  # again: nothing new to say
        out = ex.model(**ex.inputs)
        out.loss.backward()
    said = _gradckpt_warnings(caught)
    assert len(said) == 1 and "use_cache=False" in said[0], said
    # The config keeps the user's value (save_pretrained writes it); training calls get False.
    assert ex.model.config.use_cache is True
    assert getattr(out, "cache", getattr(out, "past_key_values", None)) is None
    assert _checkpoint_warnings(hf_log) == []
    gradckpt.remove(ex.model)


def test_transformers_own_switch_does_warn_per_model(hf_log):
    """The check above is not vacuous: transformers' switch with the cache on warns."""
    ex = _example("gpt2")
    _hf_enable(ex.model)
    run_step(ex)
    assert _checkpoint_warnings(hf_log)


def test_recompute_with_the_cache_on_would_grow_it():
    """Why use_cache must be off: a recomputed layer updates the KV cache a second time."""
    ex = _example("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Every layer recomputed, whatever the planner would prefer on this machine's timings.
        plan = gradckpt.plan(ex.model, ex.loss_fn, budget=1.0, profiling=gradckpt.ProfileOptions(repeats=1), solver="every_block")
    assert ex.model.config.use_cache is True  # plan() leaves the model as found
    gradckpt.apply(ex.model, plan)
    out = ex.model(**ex.inputs)
    cache = getattr(out, "cache", None) or out.past_key_values
    lengths = [layer.keys.shape[-2] for layer in cache.layers]
    out.loss.backward()
    grown = [layer.keys.shape[-2] for layer in cache.layers]
    gradckpt.remove(ex.model)
    modes = {u.path: u.mode for u in plan.units}
    recomputed = [i for i, p in enumerate(ex.block_paths) if modes[p] != "keep"]
    assert recomputed and all(grown[i] == 2 * lengths[i] for i in recomputed)


def test_plan_restores_the_cache_and_says_so_once():
    ex = _example("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradckpt.plan(ex.model, ex.loss_fn, budget=0.9, profiling=gradckpt.ProfileOptions(repeats=1))
        gradckpt.plan(ex.model, ex.loss_fn, budget=0.95, profiling=gradckpt.ProfileOptions(repeats=1))
    said = _gradckpt_warnings(caught)
    assert len(said) == 1 and "disable_cache" in said[0], said
    assert ex.model.config.use_cache is True


def test_failed_fit_leaves_the_model_as_found():
    ex = _example("t5")
    with pytest.raises(gradckpt.BudgetError):
        gradckpt.fit(ex.model, ex.loss_fn, budget=0.05, profiling=gradckpt.ProfileOptions(repeats=1))
    assert ex.model.config.use_cache is True and gradckpt.applied_plan(ex.model) is None


def test_t5_decoder_reads_its_own_config_copy():
    """model.config.use_cache = False leaves T5's decoder building a cache; fit turns all off."""
    ex = _example("t5")
    ex.model.config.use_cache = False
    assert ex.model.decoder.config.use_cache is True
    assert ex.model(**ex.inputs).cache is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gradckpt.fit(ex.model, ex.loss_fn, budget=BUDGETS["t5"], profiling=gradckpt.ProfileOptions(repeats=1))
    assert ex.model(**ex.inputs).cache is None
    gradckpt.remove(ex.model)


def test_encoder_only_model_is_fitted_without_a_cache_message():
    ex = _example("bert")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradckpt.fit(ex.model, ex.loss_fn, budget=BUDGETS["bert"], profiling=gradckpt.ProfileOptions(repeats=1))
    assert _gradckpt_warnings(caught) == []
    gradckpt.remove(ex.model)


def test_fit_replaces_transformers_own_checkpointing(hf_log):
    ex = _example("llama")
    plain = run_step(ex)
    _hf_enable(ex.model)
    assert _hf_checkpointing(ex.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = gradckpt.fit(ex.model, ex.loss_fn, budget=BUDGETS["llama"], profiling=gradckpt.ProfileOptions(repeats=1))
    said = _gradckpt_warnings(caught)
    assert len(said) == 1 and "own activation checkpointing off" in said[0], said
    assert not _hf_checkpointing(ex.model)
    # Planned against the plain step, not transformers' checkpointed one.
    assert plan.baseline_peak_bytes == plain.peak_bytes
    step = run_step(ex)
    assert step.max_grad_diff(plain) <= TOL and step.peak_bytes <= plan.budget_bytes
    gradckpt.remove(ex.model)


# --------------------------------------------------------------------------- the HF switch


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("policy", [None, gradckpt.policies.save_matmuls])
def test_enable_runs_transformers_layers_through_gradckpt(name, policy, hf_log):
    ex = _example(name)
    plain = run_step(ex)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.enable(ex.model, policy=policy)
        step = run_step(ex)
    assert len(_gradckpt_warnings(caught)) == 1  # use_cache, said once
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    funcs = [
        m._gradient_checkpointing_func
        for m in ex.model.modules()
        if getattr(m, "gradient_checkpointing", False)
    ]
    assert funcs and all(getattr(f, "__gradckpt__", False) for f in funcs)
    assert not getattr(ex.model, "_require_grads_hooks", None)  # not needed: non-reentrant
    assert step.max_grad_diff(plain) <= TOL and torch.equal(step.loss, plain.loss)
    assert step.peak_bytes < plain.peak_bytes
    assert _checkpoint_warnings(hf_log) == []
    hf.disable(ex.model)
    assert not _hf_checkpointing(ex.model) and ex.model.config.use_cache is True
    assert run_step(ex).peak_bytes == plain.peak_bytes


def test_enable_every_n_layers():
    ex = _example("gpt2", layers=4)
    hf.disable_cache(ex.model)  # nothing to say then
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.enable(ex.model, every_n_layers=2)
    flags = [ex.model.get_submodule(p).gradient_checkpointing for p in ex.block_paths]
    assert flags == [True, False, True, False]
    hf.disable(ex.model)


def test_enable_rejects_what_it_cannot_do():
    ex = _example("gpt2")
    with pytest.raises(TypeError, match=r"unknown gradckpt\.checkpoint options"):
        hf.enable(ex.model, polcy=gradckpt.policies.save_matmuls)
    with pytest.raises(ValueError, match="non-reentrant"):
        hf.enable(ex.model, use_reentrant=True)
    with pytest.raises(TypeError, match="not a transformers"):
        hf.enable(torch.nn.Linear(2, 2))
    hf.disable_cache(ex.model)
    plan = gradckpt.plan(ex.model, ex.loss_fn, budget=BUDGETS["gpt2"], profiling=gradckpt.ProfileOptions(repeats=1))
    gradckpt.apply(ex.model, plan)
    with pytest.raises(ValueError, match=r"gradckpt\.remove"):
        hf.enable(ex.model)
    gradckpt.remove(ex.model)
