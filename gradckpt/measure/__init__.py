"""Layer 3: measurement — live-storage and allocator-level memory, FLOP and op counts, timing.

Example:
    >>> from gradckpt.measure import MemoryTracker
    >>> with MemoryTracker(model) as mt:
    ...     loss_fn().backward()
    >>> mt.peak_bytes, mt.breakdown
"""

from gradckpt.measure.allocator import AllocatorTracker, MemoryEvents
from gradckpt.measure.beside import TensorsOnlyWarning
from gradckpt.measure.device import DeviceMemory, device_memory
from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.measure.flops import FlopCount, count_flops, count_ops
from gradckpt.measure.memory import MemoryTracker, format_bytes, state_bytes
from gradckpt.measure.optimizer import OptimizerMemory, OptimizerMemoryError, optimizer_memory
from gradckpt.measure.storages import StorageWatcher, storage_key
from gradckpt.measure.timing import Timing, ratio, time_fn, time_interleaved

__all__ = [
    "AllocatorTracker",
    "DeviceMemory",
    "EngineCosts",
    "FlopCount",
    "MemoryEvents",
    "MemoryTracker",
    "OptimizerMemory",
    "OptimizerMemoryError",
    "StorageWatcher",
    "TensorsOnlyWarning",
    "Timing",
    "count_flops",
    "count_ops",
    "device_memory",
    "format_bytes",
    "optimizer_memory",
    "ratio",
    "state_bytes",
    "storage_key",
    "time_fn",
    "time_interleaved",
]
