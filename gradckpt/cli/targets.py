"""TARGET: what ``gradckpt plan``/``explain``/``tune`` profile, as ``(model, loss_fn)``.

A target is one of

* a built-in name (:data:`BUILTINS`): ``tiny-gpt`` and ``unet`` from
  :mod:`gradckpt.testing`; ``gpt2-small``, ``llama-1b`` and ``vit-base`` built
  from transformers configs with random weights (nothing is downloaded; with
  ``--fake`` they are built on the meta device, so no weight is allocated);
* ``package.module:function`` — a function returning ``(model, loss_fn)`` (or an
  object with ``.model`` and ``.loss_fn``, such as :class:`gradckpt.testing.Example`);
* ``path/to/file.py:function``, or ``path/to/file.py`` defining ``make`` or ``target``.

``loss_fn`` should create its batch inside (``torch.randint(..., device=...)``)
so that under ``--fake`` the batch is a fake tensor too.

``gradckpt tune`` also needs ``make_loss(b)``: a zero-argument loss for a
micro-batch of ``b`` samples. The built-ins have one (their batch, rows repeated
or cut to ``b``); a user's function returns ``(model, loss_fn, make_loss)`` (or an
object with ``.make_loss`` too); :func:`gradckpt.tuning.sliced_loss` makes one
from a batch of tensors.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradckpt.cli.extras import CliError, require

__all__ = ["BUILTINS", "Target", "resolve"]

LossFn = Callable[[], torch.Tensor]
MakeLoss = Callable[[int], LossFn]
Made = tuple[nn.Module, LossFn, "MakeLoss | None"]


@dataclass
class Target:
    """A resolved target: the model, its loss, and how to describe it."""

    name: str
    model: nn.Module
    loss_fn: LossFn
    description: str = ""
    #: ``make_loss(b)``: the loss for a micro-batch of ``b`` samples (``gradckpt tune``).
    make_loss: MakeLoss | None = None

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


@dataclass(frozen=True)
class Builtin:
    description: str
    make: Callable[[bool, str], Made]  # (fake, device) -> (model, loss_fn, make_loss)
    needs_fake_on_cpu: bool = False

    def build(self, fake: bool, device: str) -> tuple[nn.Module, LossFn]:
        """(model, loss_fn) on ``device`` (on meta when ``fake``, for the HF built-ins)."""
        model, loss_fn, _ = self.make(fake, device)
        return model, loss_fn


# --------------------------------------------------------------------------- built-ins


def _rows(t: torch.Tensor, b: int) -> torch.Tensor:
    """The first ``b`` rows of ``t``, its rows repeated when it has fewer."""
    return t.repeat(-(-b // t.shape[0]), *[1] * (t.dim() - 1))[:b]


#: The loss of each zoo built-in on given inputs, ``(model, inputs) -> loss``: module:function
#: in gradckpt.testing (what its ``loss_fn`` runs on its fixed batch).
_ZOO_LOSS = {"gpt": "gpts:_next_token_loss", "unet": "unets:_regress"}


def _zoo(name: str, **sizes: Any) -> Callable[[bool, str], Made]:

    def build(fake: bool, device: str) -> Made:
        from gradckpt.testing import make

        # Zoo models are small: even with --fake they are built for real (the profiler
        # swaps their weights for fake tensors) and keep their fixed batch.
        ex = make(name, device=device, **sizes)
        module, _, function = _ZOO_LOSS[name].partition(":")
        of_rows = getattr(importlib.import_module(f"gradckpt.testing.{module}"), function)

        def make_loss(b: int) -> LossFn:
            rows = {k: _rows(v, b) for k, v in ex.inputs.items()}
            return lambda: of_rows(ex.model, rows)

        return ex.model, ex.loss_fn, make_loss

    return build


def _hf(kind: str) -> Callable[[bool, str], Made]:
    def build(fake: bool, device: str) -> Made:
        transformers = require("transformers", f"the built-in target {kind}")
        config, cls, inputs = _HF[kind](transformers)
        if hasattr(config, "use_cache"):
            config.use_cache = False  # training: no key/value cache
        where = torch.device("meta") if fake else torch.device(device)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # config chatter while building only
        try:
            with torch.device(where):
                model = cls(config)
        finally:
            transformers.logging.set_verbosity(verbosity)
        model.train()

        def make_loss(b: int | None = None) -> LossFn:
            def loss_fn() -> torch.Tensor:
                # The batch is made here, on the parameters' device: under --fake that is a
                # fake tensor on the device the profiler claims, so nothing is allocated.
                on = next(model.parameters()).device
                return model(**inputs(on, b)).loss

            return loss_fn

        return model, make_loss(), make_loss

    return build


def _gpt2(transformers: Any) -> tuple:
    config = transformers.GPT2Config()  # 124M: 12 layers, 768 wide, vocab 50257
    batch, seq = 8, 256

    def inputs(device: torch.device, b: int | None = None) -> dict:
        ids = torch.randint(0, config.vocab_size, (b or batch, seq), device=device)
        return {"input_ids": ids, "labels": ids}

    return config, transformers.GPT2LMHeadModel, inputs


def _llama(transformers: Any) -> tuple:
    config = transformers.LlamaConfig(  # Llama-3.2-1B's shape: 1.24B parameters
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=True,
    )  # fmt: skip
    batch, seq = 2, 1024

    def inputs(device: torch.device, b: int | None = None) -> dict:
        ids = torch.randint(0, config.vocab_size, (b or batch, seq), device=device)
        return {"input_ids": ids, "labels": ids}

    return config, transformers.LlamaForCausalLM, inputs


def _vit(transformers: Any) -> tuple:
    config = transformers.ViTConfig(num_labels=1000)  # ViT-B/16, 224x224
    batch = 8

    def inputs(device: torch.device, b: int | None = None) -> dict:
        n = b or batch
        pixels = torch.randn(n, 3, config.image_size, config.image_size, device=device)
        return {"pixel_values": pixels, "labels": torch.randint(0, 1000, (n,), device=device)}

    return config, transformers.ViTForImageClassification, inputs


_HF = {"gpt2-small": _gpt2, "llama-1b": _llama, "vit-base": _vit}

BUILTINS: dict[str, Builtin] = {
    "tiny-gpt": Builtin(
        "GPT from gradckpt.testing: 4 layers, d_model 64, seq 64, vocab 512, batch 4",
        _zoo("gpt", layers=4, d_model=64, heads=4, seq=64, vocab=512, batch=4),
    ),
    "gpt2-small": Builtin(
        "GPT-2 small (124M, transformers config, random weights), batch 8 x 256 tokens",
        _hf("gpt2-small"),
    ),
    "llama-1b": Builtin(
        "Llama-3.2-1B-shaped (1.24B, 16 layers, hidden 2048), batch 2 x 1024 tokens; "
        "plan with --fake",
        _hf("llama-1b"),
        needs_fake_on_cpu=True,
    ),
    "vit-base": Builtin(
        "ViT-B/16 (86M, transformers config, random weights), batch 8 x 224x224",
        _hf("vit-base"),
    ),
    "unet": Builtin(
        "U-Net from gradckpt.testing: depth 4, base 32 channels, batch 2 x 128x128",
        _zoo("unet", depth=4, base=32, image=128, batch=2),
    ),
}

FORMS = (
    f"a built-in ({', '.join(BUILTINS)}), package.module:function, or path/to/file.py[:function]"
)


# --------------------------------------------------------------------------- user targets


def _import_module(name: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # the console script does not put the cwd on the path
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            raise CliError(f"cannot import module {name!r} for the target (not found)") from e
        raise CliError(f"importing {name!r} failed: {type(e).__name__}: {e}") from e


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise CliError(f"target file {str(path)!r} does not exist")
    name = f"_gradckpt_target_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot load {str(path)!r} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a training script that parses its argv on import
        raise CliError(f"running {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module


def _call(spec: str, fn: Any) -> Made:
    """``fn()`` as (model, loss_fn, make_loss or None)."""
    if not callable(fn):
        raise CliError(f"target {spec!r} is not a function")
    try:
        made = fn()
    except (Exception, SystemExit) as e:
        raise CliError(f"target {spec!r} raised {type(e).__name__}: {e}") from e
    if hasattr(made, "model") and hasattr(made, "loss_fn"):
        made = (made.model, made.loss_fn, getattr(made, "make_loss", None))
    if isinstance(made, tuple) and len(made) == 2:
        made = (*made, None)
    if (
        not isinstance(made, tuple) or len(made) != 3
        or not isinstance(made[0], nn.Module) or not callable(made[1])
        or not (made[2] is None or callable(made[2]))
    ):  # fmt: skip
        raise CliError(
            f"target {spec!r} must return (model, loss_fn): an nn.Module and a zero-argument "
            f"callable returning the loss (or (model, loss_fn, make_loss) for gradckpt tune); "
            f"it returned {type(made).__name__}"
        )
    return made


def _device_type(device: str) -> str:
    try:
        return torch.device(device).type
    except RuntimeError as e:
        raise CliError(f"--device {device!r} is not a device: {e}") from None


def _split_file(spec: str) -> tuple[str, str | None] | None:
    if ".py:" in spec:
        path, _, func = spec.rpartition(":")
        return path, func
    if spec.endswith(".py"):
        return spec, None
    return None


def resolve(spec: str, *, fake: bool = False, device: str = "cpu") -> Target:
    """The target named by ``spec`` (see the module docstring); raises :class:`CliError`."""
    if spec in BUILTINS:
        builtin = BUILTINS[spec]
        kind = _device_type(device)
        if not fake and kind == "cuda" and not torch.cuda.is_available():
            raise CliError(f"--device {device}: CUDA is not available here")
        if builtin.needs_fake_on_cpu and not fake and kind == "cpu":
            raise CliError(
                f"{spec} has about 5 GB of float32 weights: plan it with --fake (no weights "
                "are allocated), or profile it for real with --device cuda"
            )
        model, loss_fn, make_loss = builtin.make(fake, device)
        return Target(spec, model, loss_fn, builtin.description, make_loss)
    file_spec = _split_file(spec)
    if file_spec is not None:
        path, func = file_spec
        module = _load_file(Path(path))
        names = [func] if func else ["make", "target"]
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None and (func or getattr(fn, "__module__", None) == module.__name__):
                # without a name, only a make()/target() defined in the file itself counts
                # (not, say, gradckpt.testing's make imported there)
                model, loss_fn, make_loss = _call(spec, getattr(module, name))
                return Target(spec, model, loss_fn, f"{name}() in {path}", make_loss)
        if func:
            raise CliError(f"{path} has no function {func!r}")
        raise CliError(f"{path} defines neither make() nor target(); name one: {path}:function")
    if ":" in spec:
        module_name, _, func = spec.partition(":")
        if not module_name or not func:
            raise CliError(f"target {spec!r} is not of the form package.module:function")
        module = _import_module(module_name)
        if not hasattr(module, func):
            raise CliError(f"module {module_name!r} has no function {func!r}")
        model, loss_fn, make_loss = _call(spec, getattr(module, func))
        return Target(spec, model, loss_fn, f"{func}() from {module_name}", make_loss)
    raise CliError(f"unknown target {spec!r}: give {FORMS}")
