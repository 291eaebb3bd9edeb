"""How offload may be used: the link, the host budget, the smallest tensor moved.

:class:`OffloadOptions` are plan data (``Plan.offload``, written in plan files)
and what the offload kind's planning parts (:mod:`gradckpt.planning.kinds.offload`)
are costed with; :func:`offload_options` reads ``offload=`` as the API takes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["OffloadOptions", "offload_options"]


@dataclass(frozen=True)
class OffloadOptions:
    """How offload may be used: the link, the host budget, the smallest tensor moved.

    Attributes:
        d2h_bandwidth: device->host bytes per second.
        h2d_bandwidth: host->device bytes per second.
        transfer_latency: fixed seconds per storage moved, each way.
        host_budget: most bytes held in host memory at once (None: no limit).
            Pinned pages are not swappable: state what the host can spare.
        min_bytes: storages smaller than this are never moved.
        prefetch: load a unit's tensors one offloaded unit ahead of its backward.
        stream: ``Offload`` units move each saved tensor when it is saved and bring
            it back one tensor ahead of its use, instead of all of a unit's tensors
            after its forward and before its backward: a unit's backward then holds
            a tensor or two of what it saved, not all of it, so the least peak falls
            below recompute's; compute waits for every copy out and for copies back
            the backward does not cover (:mod:`gradckpt.planning.kinds.offload.stream`).

    Example:
        >>> gradckpt.plan(model, loss_fn, "1GiB", offload=OffloadOptions(host_budget=8 << 30))
    """

    d2h_bandwidth: float = 25e9
    h2d_bandwidth: float = 25e9
    transfer_latency: float = 20e-6
    host_budget: int | None = None
    min_bytes: int = 4096
    prefetch: bool = True
    stream: bool = False

    def __post_init__(self) -> None:
        for name in ("d2h_bandwidth", "h2d_bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    f"OffloadOptions.{name} must be a positive number of bytes per second "
                    f"(e.g. 25e9 for PCIe Gen4 x16), got {value!r}"
                )
        if not isinstance(self.transfer_latency, (int, float)) or self.transfer_latency < 0:
            raise ValueError(
                f"OffloadOptions.transfer_latency must be seconds >= 0, got "
                f"{self.transfer_latency!r}"
            )
        if self.host_budget is not None and (
            isinstance(self.host_budget, bool)
            or not isinstance(self.host_budget, int)
            or self.host_budget < 0
        ):
            raise ValueError(
                f"OffloadOptions.host_budget must be bytes (an int >= 0) or None, got "
                f"{self.host_budget!r}"
            )
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int) or (
            self.min_bytes < 1
        ):
            raise ValueError(f"OffloadOptions.min_bytes must be an int >= 1, got {self.min_bytes!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OffloadOptions:
        return cls(**data)


def offload_options(value: Any) -> OffloadOptions | None:
    """``offload=`` as the API takes it: False/None (off), True (defaults), or options.

    Example:
        >>> offload_options(True).d2h_bandwidth
        25000000000.0
    """
    if value is None or value is False:
        return None
    if value is True:
        return OffloadOptions()
    if isinstance(value, OffloadOptions):
        return value
    if isinstance(value, dict):
        try:
            return OffloadOptions(**value)
        except TypeError as e:
            raise TypeError(f"offload= as a dict takes OffloadOptions' fields: {e}") from None
    raise TypeError(
        f"offload= is False (default), True, or gradckpt.OffloadOptions(...); got {value!r}"
    )
