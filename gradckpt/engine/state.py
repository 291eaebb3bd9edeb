"""Global state captured at the start of a region and re-entered for its recompute.

The recompute must see what the forward saw: the same RNG stream (dropout
masks), the same autocast settings and the same ``torch.device(...)`` context.
It must also leave the caller's RNG stream where it was, so it runs under
``torch.random.fork_rng``.

Beyond torch's checkpoint, the RNG streams of Python's ``random`` module and
NumPy's global ``np.random`` (when NumPy is loaded) are replayed the same way:
a block that draws from them (random crops, token dropping, stochastic depth
decided in Python) recomputes the same draws. Generators a block owns
(``np.random.default_rng()``, ``random.Random()``) are its own business.
Reading those two streams cheaply is :mod:`gradckpt.engine.host_rng`'s part.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack as _function_mode_stack
from torch.utils._device import DeviceContext

from gradckpt.engine.host_rng import NUMPY, PYTHON

__all__ = ["ReplayState", "capture_state", "infer_device_type"]


def infer_device_type(tensors: Iterable[torch.Tensor]) -> str:
    """The non-CPU device type of the tensors ("cuda" when all are on the CPU)."""
    types = []
    for t in tensors:
        kind = t.device.type
        if kind != "cpu" and kind not in types:
            types.append(kind)
    if len(types) > 1:
        warnings.warn(
            f"checkpointed inputs are on several device types {types}; only the RNG state "
            f"of {types[0]!r} is preserved for the recompute. Keep a region's inputs on "
            "one device type to have dropout replayed exactly everywhere.",
            stacklevel=4,
        )
    return types[0] if types else "cuda"


def _device_module(device_type: str) -> Any:
    return getattr(torch, device_type, None)


def _device_initialized(device_type: str) -> bool:
    module = _device_module(device_type)
    if module is None:
        return False
    probe = getattr(module, "is_initialized", None)
    if callable(probe):
        return bool(probe())
    return bool(getattr(module, "_initialized", False))


def _autocast_settings(device_type: str) -> tuple[bool, torch.dtype, bool] | None:
    if device_type == "meta" or not torch.amp.is_autocast_available(device_type):
        return None
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


def _current_device_context() -> Any:
    """The innermost ``torch.device(...)`` context in force, or None."""
    for mode in reversed(_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode
    return None


@dataclass
class ReplayState:
    """RNG, autocast and device context of a region's forward, for its recompute."""

    preserve_rng: bool
    device_type: str
    cpu_rng: torch.Tensor | None
    devices: list[int]
    device_rngs: list[torch.Tensor]
    device_was_initialized: bool
    autocast: dict[str, tuple[bool, torch.dtype, bool]]
    device_context: Any
    python_rng: Any = None
    numpy_rng: Any = None
    #: What tells, after the forward, whether the region drew from each host
    #: stream (:mod:`gradckpt.engine.host_rng`; None: compare full states).
    python_mark: Any = None
    numpy_mark: Any = None

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the recompute under the forward's RNG, autocast and device context."""
        with contextlib.ExitStack() as stack:
            if self.preserve_rng:
                self._replay_rngs(stack)
            for device_type, settings in self.autocast.items():
                # Entered only where it differs now (a recompute in backward runs
                # outside the forward's autocast): the same settings either way.
                if _autocast_settings(device_type) != settings:
                    enabled, dtype, cache = settings
                    stack.enter_context(
                        torch.autocast(
                            device_type, enabled=enabled, dtype=dtype, cache_enabled=cache
                        )
                    )
            if self.device_context is not None:
                stack.enter_context(self.device_context)
            yield

    def _replay_rngs(self, stack: contextlib.ExitStack) -> None:
        # The forward's streams for the recompute; the caller's go back after it
        # (what torch.random.fork_rng does, without its second CPU state copy).
        cpu_now = torch.get_rng_state()
        module = _device_module(self.device_type)
        device_now = [module.get_rng_state(d) for d in self.devices]

        def restore() -> None:
            torch.set_rng_state(cpu_now)
            for device, state in zip(self.devices, device_now):
                module.set_rng_state(state, device)

        stack.callback(restore)
        torch.set_rng_state(self.cpu_rng)
        for device, state in zip(self.devices, self.device_rngs):
            module.set_rng_state(state, device)
        self._replay_host_rngs(stack)

    def _replay_host_rngs(self, stack: contextlib.ExitStack) -> None:
        # The caller's streams go back once the recompute ends.
        for stream, state in ((PYTHON, self.python_rng), (NUMPY, self.numpy_rng)):
            if state is not None:
                stack.callback(stream.set_state, stream.get_state())
                stream.set_state(state)

    def forget_unused_host_rngs(self) -> None:
        """After the forward: drop host RNG states the region did not draw from.

        Most regions never touch ``random`` or ``np.random``; their recompute
        then skips the host replay (a NumPy state costs tens of microseconds to
        read or write).
        """
        if self.python_rng is not None and not PYTHON.drew(self.python_rng, self.python_mark):
            self.python_rng = None
        if self.numpy_rng is not None and not NUMPY.drew(self.numpy_rng, self.numpy_mark):
            self.numpy_rng = None
        self.python_mark = self.numpy_mark = None

    def check_device_not_initialized_inside(self) -> None:
        """Raise if the forward initialized the device, whose RNG we therefore missed."""
        if (
            self.preserve_rng
            and not self.device_was_initialized
            and _device_initialized(self.device_type)
        ):
            raise RuntimeError(
                f"the {self.device_type} device was initialized inside a checkpointed region, "
                "so its RNG state could not be saved for the recompute. Initialize the device "
                "before the first checkpointed call (e.g. move the model to it), or pass "
                "preserve_rng_state=False."
            )


def capture_state(tensors: list[torch.Tensor], preserve_rng: bool) -> ReplayState:
    """Capture what the recompute of a region starting now must replay."""
    device_type = infer_device_type(tensors)
    initialized = _device_initialized(device_type)
    devices: list[int] = []
    device_rngs: list[torch.Tensor] = []
    if preserve_rng and initialized:
        module = _device_module(device_type)
        devices = sorted({t.get_device() for t in tensors if t.device.type == device_type})
        device_rngs = [module.get_rng_state(d) for d in devices]
    autocast = {}
    for kind in dict.fromkeys((device_type, "cpu")):
        settings = _autocast_settings(kind)
        if settings is not None:
            autocast[kind] = settings
    python_rng = python_mark = numpy_rng = numpy_mark = None
    if preserve_rng:
        python_rng, python_mark = PYTHON.capture()
        numpy_rng, numpy_mark = NUMPY.capture()
    return ReplayState(
        preserve_rng=preserve_rng,
        device_type=device_type,
        cpu_rng=torch.get_rng_state() if preserve_rng else None,
        devices=devices,
        device_rngs=device_rngs,
        device_was_initialized=initialized,
        autocast=autocast,
        device_context=_current_device_context(),
        python_rng=python_rng,
        numpy_rng=numpy_rng,
        python_mark=python_mark,
        numpy_mark=numpy_mark,
    )
