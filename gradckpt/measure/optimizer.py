"""An optimizer's memory, predicted on fake tensors: its state and the temporaries of its step.

Besides parameters and gradients the device holds the optimizer's state from
the first ``optimizer.step()`` on (AdamW: two tensors per parameter) and,
during each step, its temporaries (the foreach path makes them for all
parameters at once, the for-loop path for one at a time). :func:`optimizer_memory`
builds a fresh optimizer of the same class and param groups over fake
parameters and replays two steps under a :class:`~gradckpt.measure.MemoryTracker`:
no real memory, and the bytes of the real run (``tests/measure/test_optimizer_memory.py``).
Not seen: scratch a kernel allocates inside itself (CPU bf16 matmul, in Adafactor's step).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.optim import Optimizer
from torch.utils._pytree import tree_map_only

from gradckpt.measure.allocator import AllocatorTracker
from gradckpt.measure.memory import MemoryTracker
from gradckpt.measure.storages import storage_key

__all__ = [
    "OptimizerMemory",
    "OptimizerMemoryError",
    "fresh_optimizer",
    "optimizer_memory",
    "optimizer_state_sizes",
]

_NAMES = {n.lower(): n for n in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adafactor")}
_WAY_OUT = "pass optimizer=None to plan without counting the optimizer"
# Group flags that change what the step holds, named in OptimizerMemory.name.
_FLAGS = ("momentum", "nesterov", "amsgrad", "centered")


class OptimizerMemoryError(ValueError):
    """The optimizer's memory cannot be predicted (one line, naming ``optimizer=None``)."""


@dataclass(frozen=True)
class OptimizerMemory:
    """Bytes an optimizer adds to a training step, above parameters and gradients.

    Example:
        >>> om = optimizer_memory(model, "adamw")
        >>> om.state_bytes  # 2 x parameter bytes, plus one 'step' scalar per parameter
        >>> OptimizerMemory.from_json(om.to_json()) == om
        True
    """

    name: str  # class and implementation, e.g. "AdamW (foreach)"
    state_bytes: int  # state resident after the first step, each storage once
    first_step_bytes: int  # peak the first step adds above params + grads
    step_bytes: int  # peak a later step adds above params + grads + state
    method: str  # "fake" (replayed on fake tensors) or "measured" (ran for real)

    def __post_init__(self) -> None:
        if self.method not in ("fake", "measured"):
            raise ValueError(f"method is 'fake' or 'measured', got {self.method!r}")

    @property
    def step_peak_bytes(self) -> int:
        """The most the step phase adds over params + grads: the first step or a later one."""
        return max(self.first_step_bytes, self.state_bytes + self.step_bytes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OptimizerMemory:
        ints = {k: int(data[k]) for k in ("state_bytes", "first_step_bytes", "step_bytes")}
        return cls(name=str(data["name"]), method=str(data["method"]), **ints)


@dataclass
class _Spec:
    """How to build a fresh optimizer like the one asked about."""

    cls: type[Optimizer]
    kwargs: dict[str, Any]  # constructor keywords
    groups: list[tuple[list[torch.Tensor], dict[str, Any]]]  # (real params, hyperparameters)
    defaults: dict[str, Any] | None  # a live optimizer's defaults, set on the fresh one


def _copied(spec: _Spec, mode: FakeTensorMode | None = None) -> _Spec:
    """The spec with hyperparameters of its own; for ``mode``, its tensors as fake constants.

    Constants keep their values, so ``lr < 0`` in a constructor reads the real lr.
    """

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.numel() > 1:
            return mode.from_tensor(t)
        return mode.fake_tensor_converter.from_real_tensor(mode, t, make_constant=True)

    # Deep copies, made outside the fake mode (copying a real tensor there fails).
    own = copy.deepcopy((spec.kwargs, [h for _, h in spec.groups], spec.defaults))
    kwargs, hypers, defaults = own if mode is None else tree_map_only(torch.Tensor, fake, own)
    groups = [(ps, h) for (ps, _), h in zip(spec.groups, hypers)]
    return _Spec(spec.cls, kwargs, groups, defaults)


def _fail(what: str) -> OptimizerMemoryError:
    return OptimizerMemoryError(f"{what}; {_WAY_OUT}")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _resolve(model: nn.Module | None, optimizer: Any) -> _Spec:
    """What to build: class, constructor keywords, param groups (over real params), defaults.

    Example:
        >>> _resolve(model, "adamw").cls
        <class 'torch.optim.adamw.AdamW'>
    """
    if isinstance(optimizer, Optimizer):
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [
            (list(g["params"]), {k: v for k, v in g.items() if k != "params"})
            for g in optimizer.param_groups
        ]
        # Copied: a hyperparameter tensor (lr) must not be shared with the live optimizer.
        return _copied(_Spec(cls, kwargs, groups, dict(optimizer.defaults)))
    kwargs: Any = {}
    if isinstance(optimizer, str):
        cls = getattr(torch.optim, _NAMES.get(optimizer.lower(), ""), None)
        if cls is None:
            raise _fail(f"unknown optimizer {optimizer!r} (known: {', '.join(_NAMES)})")
    elif isinstance(optimizer, tuple) and len(optimizer) == 2:
        cls, kwargs = optimizer
    else:
        cls = optimizer
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)) or not isinstance(
        kwargs, Mapping
    ):
        raise _fail(
            f"optimizer={optimizer!r} is not an optimizer: give a torch.optim.Optimizer, its "
            f"class, a (class, kwargs) pair or one of {', '.join(map(repr, _NAMES))}"
        )
    if not isinstance(model, nn.Module):
        raise _fail(f"optimizer={cls.__name__} needs the model whose parameters it steps")
    kwargs = dict(kwargs)
    lr = inspect.signature(cls.__init__).parameters.get("lr")
    if "lr" not in kwargs and lr is not None and lr.default is inspect.Parameter.empty:
        kwargs["lr"] = 1e-3
    params = [p for p in model.parameters() if p.requires_grad]
    return _Spec(cls, kwargs, [(params, {})] if params else [], None)


def _target(p: torch.Tensor, device: torch.device | None) -> torch.device:
    if device is not None:
        return device
    return torch.device("cpu") if p.is_meta else p.device


def _twins(spec: _Spec, device: torch.device | None, fake: bool) -> list[list[torch.Tensor]]:
    """Per group, a twin of each param (same shape, strides, dtype) with a gradient if it trains.

    Fake twins are empty; real ones are clones with zero gradients. Whether params
    share storages does not matter: the step's own allocations do not depend on it.
    """
    out = []
    for params, _ in spec.groups:
        twins = []
        for p in params:
            where = _target(p, device)
            if fake:
                t = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=where)
            else:
                t = p.detach().to(where, copy=True)
            t.requires_grad_(p.requires_grad)
            if p.requires_grad:
                t.grad = torch.empty_like(t) if fake else torch.zeros_like(t)
            twins.append(t)
        out.append(twins)
    return out


def _implementation(group: dict[str, Any], params: list[torch.Tensor], real: list) -> str | None:
    """The path torch takes ("fused", "foreach", "for-loop") on the real params' devices."""
    if "foreach" not in group and "fused" not in group:
        return None
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        # Decided here, not by torch on the fakes: FakeTensor is not among the types
        # torch sends down the foreach path, so a fake CUDA run would take the for-loop.
        from torch.optim.optimizer import _foreach_supported_types as types
        from torch.optim.optimizer import _get_foreach_kernels_supported_devices as devices

        foreach = (
            not group.get("differentiable", False)
            and all(type(p) in types for p in real)
            and all(p.device.type in devices() for p in params)
            and not (isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"))
        )
    return "foreach" if foreach else "for-loop"


def _build(spec: _Spec, params: list[list[torch.Tensor]]) -> tuple[Optimizer, str]:
    """A fresh optimizer over ``params`` with the spec's groups, and its name."""
    groups = [{"params": ps, **h} for ps, (_, h) in zip(params, spec.groups)]
    try:
        opt = spec.cls(groups, **spec.kwargs)
    except Exception as e:
        raise _fail(f"cannot build a fresh {spec.cls.__name__} ({_one_line(e)})") from e
    if spec.defaults is not None:
        opt.defaults = spec.defaults
    flags, impls = [], []
    for group, ps, (real, _) in zip(opt.param_groups, params, spec.groups):
        impl = _implementation(group, ps, real)
        if impl is not None and group.get("foreach", False) is None and impl != "fused":
            group["foreach"] = impl == "foreach"
        impls += [impl] if impl is not None and impl not in impls else []
        flags += [f for f in _FLAGS if f not in flags and _truthy(group.get(f))]
    parts = ", ".join([*flags, "/".join(impls)] if impls else flags)
    return opt, f"{spec.cls.__name__} ({parts})" if parts else spec.cls.__name__


def _truthy(value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return bool(value)
    if isinstance(value, FakeTensor):
        value = value.constant
    if value is None or value.numel() != 1:
        return True  # no value to read: name the flag
    with unset_fake_temporarily():
        return bool(value.item())


def optimizer_state_sizes(opt: Optimizer) -> dict[int, int]:
    """Storage key -> bytes, over every tensor in ``opt.state`` (nested too), each once.

    Example:
        >>> sum(optimizer_state_sizes(opt).values())  # AdamW after a step: 2 x params + steps
    """
    found: dict[int, int] = {}
    todo: list[Any] = list(opt.state.values())
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            found[storage_key(item)] = item.untyped_storage().nbytes()
        elif isinstance(item, Mapping):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return found


class _StepTracker(MemoryTracker):
    """A tracker that knows which created storages are alive at exit, and may answer ``.item()``.

    ``.item()`` of a fake tensor has no value. torch's own optimizers use such
    values only for Python scalars (Adafactor's step size), never for what they
    allocate, so for them it is answered with 1: the bytes stay exact.
    """

    def __init__(self, placeholders: bool) -> None:
        super().__init__()
        self.placeholders = placeholders
        self.alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.placeholders and func is torch.ops.aten._local_scalar_dense.default:
            try:
                return func(*args, **(kwargs or {}))
            except DataDependentOutputException:
                dtype = args[0].dtype
                return 1.0 if dtype.is_floating_point else True if dtype == torch.bool else 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _on_alloc(self, key: int, nbytes: int) -> None:
        super()._on_alloc(key, nbytes)
        self.alive.add(key)

    def _on_free(self, key: int) -> None:
        super()._on_free(key)
        self.alive.discard(key)


def _replay(spec: _Spec, device: torch.device | None) -> OptimizerMemory:
    placeholders = f"{spec.cls.__module__}.".startswith("torch.optim.")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    spec = _copied(spec, mode)
    with mode:
        params = _twins(spec, device, fake=True)
        # The constructor is inside: some optimizers (Adagrad) make their state there.
        with _StepTracker(False) as first:
            opt, name = _build(spec, params)
            first.placeholders = placeholders  # the constructor's checks read real values
            opt.step()
        with _StepTracker(placeholders) as later:
            opt.step()
    state = optimizer_state_sizes(opt)
    # Tensors made from Python data (torch.tensor(0.) for 'step') reach no op the
    # tracker sees; they are alive at the end, so count them in the first step.
    unseen = sum(n for key, n in state.items() if key not in first.alive)
    scalar = _wrapped_scalar_bytes([p for ps in params for p in ps])
    return OptimizerMemory(
        name,
        sum(state.values()),
        first.peak_created_bytes + unseen + scalar,
        later.peak_created_bytes + scalar,
        "fake",
    )


def _wrapped_scalar_bytes(params: list[torch.Tensor]) -> int:
    """What the CPU allocator holds for a Python number during an op: no op returns it.

    ``buf.mul_(0.9)`` on CPU wraps 0.9 in a 0-dim double (8 bytes) and casts it to
    the op's dtype, for the op's duration; every step has such ops (``step += 1``).
    Device allocators never see them: those tensors live on the CPU.
    """
    on_cpu = [p.element_size() for p in params if p.device.type == "cpu"]
    return 8 + max(on_cpu) if on_cpu else 0


def _measure(spec: _Spec, device: torch.device | None, why_not_fake: str) -> OptimizerMemory:
    spec, params = _copied(spec), _twins(spec, device, fake=False)
    where = next(p.device for ps in params for p in ps)
    try:
        with AllocatorTracker(where) as first:
            opt, name = _build(spec, params)
            opt.step()
        with AllocatorTracker(where) as later:
            opt.step()
    except OptimizerMemoryError:
        raise
    except Exception as e:
        raise _fail(
            f"{spec.cls.__name__}.step() runs neither on fake tensors ({why_not_fake}) "
            f"nor for real ({_one_line(e)})"
        ) from e
    state = sum(optimizer_state_sizes(opt).values())
    return OptimizerMemory(name, state, first.peak_bytes, later.peak_bytes, "measured")


def optimizer_memory(
    model: nn.Module | None, optimizer: Any, *, device: str | torch.device | None = None
) -> OptimizerMemory:
    """State bytes and step peaks of ``optimizer`` over ``model``, replayed on fake tensors.

    ``optimizer``: a live ``torch.optim.Optimizer`` (never touched: a fresh one of
    its class with its param groups and defaults is built), its class, a
    ``(class, kwargs)`` pair, or one of "sgd", "adam", "adamw", "adagrad",
    "rmsprop", "adafactor" (torch's defaults); but for a live optimizer, over the
    model's parameters that require grad. Fake params have the real ones' shapes, dtypes
    and devices (``device`` overrides; a meta model's go to "cpu"); those that
    require grad get a gradient. Steps that cannot run on fake tensors (an op
    without a fake kernel, a custom optimizer reading ``.item()``) are measured
    once for real instead, over clones of the params with zero grads: that takes
    params + grads + state of real memory (``method="measured"``).

    Raises:
        OptimizerMemoryError: not an optimizer, or neither way works (a meta model).

    Example:
        >>> om = optimizer_memory(model, "adamw")
        >>> om.name, om.state_bytes, om.step_peak_bytes
        ('AdamW (for-loop)', 1579032, 2104356)
    """
    spec = _resolve(model, optimizer)
    target = torch.device(device) if device is not None else None
    if not spec.groups:
        return OptimizerMemory(spec.cls.__name__, 0, 0, 0, "fake")
    try:
        return _replay(spec, target)
    except OptimizerMemoryError:
        raise
    except Exception as e:
        reason = _one_line(e)
    if any(p.is_meta or isinstance(p, FakeTensor) for ps, _ in spec.groups for p in ps):
        raise _fail(
            f"{spec.cls.__name__}.step() does not run on fake tensors ({reason}) and the model "
            "has no real parameters to measure it on"
        )
    return _measure(spec, target, reason)


def fresh_optimizer(model: nn.Module | None, optimizer: Any, **overrides: Any) -> Optimizer:
    """A new optimizer of ``optimizer``'s class, groups and defaults over the real parameters.

    ``overrides`` replace a hyperparameter in every group (``lr=0.0``: a step that
    leaves the parameters as they are, to time it). The live optimizer is not touched.

    Example:
        >>> timing = fresh_optimizer(model, opt, lr=0.0, weight_decay=0.0)
    """
    spec = _copied(_resolve(model, optimizer))
    for _, hyper in spec.groups:
        hyper.update({k: v for k, v in overrides.items() if k in hyper or k == "lr"})
    return _build(spec, [list(ps) for ps, _ in spec.groups])[0]
