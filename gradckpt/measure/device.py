"""``budget="auto"``: the memory of the device the model is on, less a stated headroom.

The rule, as the README quotes it:

* **CPU.** available = ``MemAvailable`` (``/proc/meminfo``) + ``held_bytes`` (the
  model's parameter and buffer bytes, which ``MemAvailable`` already excludes but
  the step holds anyway). When a cgroup memory limit is set (v2
  ``memory.max - memory.current``, v1 ``memory.limit_in_bytes - memory.usage_in_bytes``)
  and it is smaller than ``MemAvailable``, the limit's free bytes are used instead.
  Without ``/proc/meminfo`` (macOS) it is ``SC_AVPHYS_PAGES * SC_PAGE_SIZE``. Headroom:
  10% of available (other processes grow; the CPU allocator keeps no cache, but glibc
  arenas and Python objects take memory the plan does not see).
* **CUDA.** available = free (``torch.cuda.mem_get_info``) + ``memory_reserved(device)``
  (the caching allocator's blocks are ours to reuse). Headroom: the larger of 5% of
  the device's total and 256 MiB (the allocator's reserve above allocated bytes, and
  fragmentation).
* ``reserve_fraction`` replaces the 10% / 5% (for instance reserved/allocated - 1,
  measured on the profiled step); the 256 MiB floor on CUDA stays.
* ``meta`` and other devices are refused: give the budget in bytes.

budget = max(available - headroom, 0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gradckpt.measure.memory import format_bytes

__all__ = ["DeviceMemory", "device_memory"]

CPU_RESERVE = 0.10
CUDA_RESERVE = 0.05
CUDA_FLOOR_BYTES = 256 << 20
# Module-level so tests can point them at a tmp folder.
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")
_WAY_OUT = "pass the budget in bytes instead (budget='12GiB' or an int)"


@dataclass(frozen=True)
class DeviceMemory:
    """The memory a step on ``device`` may use, and the rule that gave it.

    Example:
        >>> m = device_memory("cpu", held_bytes=state_bytes(model))
        >>> print(m.line())  # auto budget: 16.42 GiB on cpu = MemAvailable ...
    """

    device: str
    total_bytes: int
    available_bytes: int
    held_bytes: int
    headroom_bytes: int
    rule: str

    @property
    def budget_bytes(self) -> int:
        """Available less headroom, never below 0.

        Example:
            >>> DeviceMemory("cpu", 100, 50, 0, 5, "").budget_bytes
            45
        """
        return max(self.available_bytes - self.headroom_bytes, 0)

    def line(self) -> str:
        """One line for a person: the budget, the device and the rule.

        Example:
            >>> DeviceMemory("cpu", 1 << 30, 1 << 30, 0, 0, "all of it").line()
            'auto budget: 1.00 GiB on cpu = all of it'
        """
        return f"auto budget: {_gib(self.budget_bytes)} on {self.device} = {self.rule}"


def device_memory(
    device: str | torch.device = "cpu",
    *,
    held_bytes: int = 0,
    reserve_fraction: float | None = None,
) -> DeviceMemory:
    """Measure ``device`` now and apply the rule of this module's docstring.

    ``held_bytes`` (CPU only) is what the process already holds that the step also
    holds, usually ``state_bytes(model)``; on CUDA ``memory_reserved`` plays that part.

    Example:
        >>> device_memory("cpu", held_bytes=40).budget_bytes > 0
        True
    """
    dev = torch.device(device)
    if reserve_fraction is not None and not 0.0 <= reserve_fraction < 1.0:
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
    if held_bytes < 0:
        raise ValueError(f"held_bytes must be >= 0, got {held_bytes!r}")
    if dev.type == "meta":
        raise ValueError(
            "budget='auto' needs the real device, and the model is on 'meta' (no memory "
            f"to measure; a meta model is not planned for the CPU's memory): {_WAY_OUT}"
        )
    if dev.type == "cpu":
        return _cpu(held_bytes, CPU_RESERVE if reserve_fraction is None else reserve_fraction)
    if dev.type == "cuda":
        return _cuda(dev, CUDA_RESERVE if reserve_fraction is None else reserve_fraction)
    raise ValueError(f"budget='auto' can measure cpu and cuda, not {dev.type!r}: {_WAY_OUT}")


def _cpu(held: int, fraction: float) -> DeviceMemory:
    meminfo = _read_meminfo()
    if "MemAvailable" in meminfo and "MemTotal" in meminfo:
        free, total, source = meminfo["MemAvailable"], meminfo["MemTotal"], "MemAvailable"
    else:
        free, total = _sysconf_memory()
        source = "available pages"
    cgroup = _cgroup_free()
    if cgroup is not None and cgroup < free:
        # In a container MemAvailable is the host's; the cgroup kills us first.
        free, source = cgroup, "cgroup limit free"
    available = free + held
    headroom = int(fraction * available)
    rule = (
        f"{source} {_gib(free)} + model {_gib(held)} held, less {fraction:.0%} headroom "
        "(other processes, allocator, Python objects)"
    )
    return DeviceMemory("cpu", total, available, held, headroom, rule)


def _cuda(dev: torch.device, fraction: float) -> DeviceMemory:
    if not torch.cuda.is_available():
        raise ValueError(f"budget='auto' on {dev} but CUDA is not available: {_WAY_OUT}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    reserved = int(torch.cuda.memory_reserved(index))
    available = int(free) + reserved
    headroom = max(int(fraction * total), CUDA_FLOOR_BYTES)
    rule = (
        f"free {_gib(int(free))} + reserved {_gib(reserved)} (our cache), less "
        f"max({fraction:.0%} of {_gib(int(total))}, 256 MiB) headroom "
        "(allocator reserve, fragmentation)"
    )
    return DeviceMemory(f"cuda:{index}", int(total), available, reserved, headroom, rule)


def _read_meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes ({} where there is none, as on macOS)."""
    try:
        text = _MEMINFO.read_text()
    except OSError:
        return {}
    out = {}
    for row in text.splitlines():
        name, _, rest = row.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            # The kernel writes "kB" and means KiB.
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _sysconf_memory() -> tuple[int, int]:
    """(available, total) bytes from sysconf, where the platform has the names."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * page
        total = os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        raise ValueError(
            "budget='auto' cannot read this machine's free memory (no /proc/meminfo, no "
            f"sysconf SC_AVPHYS_PAGES): {_WAY_OUT}"
        ) from None
    if free <= 0 or total <= 0:
        raise ValueError(f"budget='auto' read no free memory from sysconf: {_WAY_OUT}")
    return free, total


def _cgroup_free() -> int | None:
    """Bytes left under the cgroup memory limit (v2, else v1), or None where none is set."""
    for limit_name, usage_name in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(_CGROUP / limit_name), _read_int(_CGROUP / usage_name)
        if limit is not None and usage is not None:
            # v1 writes "no limit" as a huge number; the min with MemAvailable drops it.
            return max(limit - usage, 0)
    return None


def _read_int(path: Path) -> int | None:
    """The integer in ``path``; None if missing, unreadable or "max" (v2's no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _gib(nbytes: int) -> str:
    return format_bytes(nbytes, unit="GiB")
