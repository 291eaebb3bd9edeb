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
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

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
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:  # pragma: no cover - older torch
        return None
    for mode in reversed(_get_current_function_mode_stack()):
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
    #: The NumPy generator's raw words at capture (see _numpy_words), when they
    #: alone tell whether the region drew: then the check after the forward
    #: costs a microsecond instead of another full state read.
    numpy_words: bytes | None = None

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the recompute under the forward's RNG, autocast and device context."""
        with contextlib.ExitStack() as stack:
            if self.preserve_rng:
                # fork_rng forks nothing, not even the CPU RNG, for device_type
                # "meta" (a meta tensor among the inputs): restore the CPU RNG here.
                stack.callback(torch.set_rng_state, torch.get_rng_state())
                stack.enter_context(
                    torch.random.fork_rng(devices=self.devices, device_type=self.device_type)
                )
                torch.set_rng_state(self.cpu_rng)
                module = _device_module(self.device_type)
                for device, state in zip(self.devices, self.device_rngs):
                    module.set_rng_state(state, device)
                self._replay_host_rngs(stack)
            for device_type, (enabled, dtype, cache) in self.autocast.items():
                stack.enter_context(
                    torch.autocast(device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)
                )
            if self.device_context is not None:
                stack.enter_context(self.device_context)
            yield

    def _replay_host_rngs(self, stack: contextlib.ExitStack) -> None:
        # The caller's streams go back once the recompute ends.
        if self.python_rng is not None:
            stack.callback(random.setstate, random.getstate())
            random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            numpy_random = _numpy_random()
            if numpy_random is not None:
                stack.callback(numpy_random.set_state, numpy_random.get_state())
                numpy_random.set_state(self.numpy_rng)

    def forget_unused_host_rngs(self) -> None:
        """After the forward: drop host RNG states the region did not draw from.

        Most regions never touch ``random`` or ``np.random``; their recompute
        then skips the host replay (a NumPy state costs tens of microseconds to
        read or write).
        """
        if self.python_rng is not None and random.getstate() == self.python_rng:
            self.python_rng = None
        if self.numpy_rng is not None:
            if self.numpy_words is not None:
                unused = _numpy_words() == self.numpy_words
            else:
                unused = _same_numpy_state(_numpy_state(), self.numpy_rng)
            if unused:
                self.numpy_rng = None
        self.numpy_words = None

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


def _numpy_random() -> Any:
    # Only a NumPy the program already imported: gradckpt never imports it.
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


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
    numpy_rng = _numpy_state() if preserve_rng else None
    return ReplayState(
        preserve_rng=preserve_rng,
        device_type=device_type,
        cpu_rng=torch.get_rng_state() if preserve_rng else None,
        devices=devices,
        device_rngs=device_rngs,
        device_was_initialized=initialized,
        autocast=autocast,
        device_context=_current_device_context(),
        python_rng=random.getstate() if preserve_rng else None,
        numpy_rng=numpy_rng,
        numpy_words=_words_telling_use(numpy_rng),
    )


def _numpy_state() -> Any:
    numpy_random = _numpy_random()
    return numpy_random.get_state() if numpy_random is not None else None


#: Bytes of NumPy's Mersenne Twister state struct: 624 32-bit words and an int position.
_MT_STATE_BYTES = 624 * 4 + 4


def _numpy_words() -> bytes | None:
    """The raw state of NumPy's global generator, read in place (~1 us; get_state: ~30 us).

    None when it cannot be read so (another NumPy layout or generator).
    """
    numpy_random = _numpy_random()
    try:
        address = numpy_random.mtrand._rand._bit_generator.ctypes.state_address
    except Exception:  # any other NumPy: the full state is read instead
        return None
    import ctypes

    return ctypes.string_at(address, _MT_STATE_BYTES)


def _words_telling_use(state: Any) -> bytes | None:
    """The raw words at capture, if comparing them later tells whether the region drew.

    Every draw moves the Mersenne Twister, except a normal draw that takes the
    Gaussian the legacy generator cached from the previous pair: so the words
    tell only when no Gaussian is cached. They are checked against the full
    state just read, so a layout other than the expected one is never trusted.
    """
    if state is None or len(state) != 5 or state[0] != "MT19937" or state[3]:
        return None
    words = _numpy_words()
    if words is None:
        return None
    expected = state[1].astype("<u4").tobytes() + int(state[2]).to_bytes(4, "little", signed=True)
    if sys.byteorder != "little" or words != expected:
        return None
    return words


def _same_numpy_state(now: Any, then: Any) -> bool:
    # Legacy state tuples: (name, key array, position, has_gauss, cached_gaussian).
    if now is None or len(now) != len(then):
        return False
    if any(a != b for i, (a, b) in enumerate(zip(now, then)) if i != 1):
        return False
    return bool((now[1] == then[1]).all())
