"""The runtime side of ``Offload`` units: one offload session per applied model.

``apply`` gives every offloaded unit's spec the same :class:`OffloadRuntime`
(made by the offload kind's handler, :mod:`gradckpt.planning.kinds.offload.handler`);
``RecomputeOffload`` units share it (their kept inputs join the same stash
and prefetch order). Its session (made at the first call, for the device the
unit's tensors are on) orders the copies of all of them: the one-deep forward stash and the prefetch
run across units. On CPU the backend is the host copy (exact, no overlap); on
CUDA the pinned-pool backend (not yet run on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradckpt.engine.offload.boundary import boundary_argument, run_boundary_offloaded
from gradckpt.engine.offload.session import OffloadSession, run_offloaded
from gradckpt.engine.offload.store import HostCopyBackend
from gradckpt.engine.offload.stream import run_streamed

__all__ = ["OffloadRuntime"]


class OffloadRuntime:
    """Options and the (lazily made) session shared by a model's offloaded units.

    Example:
        >>> runtime = OffloadRuntime(min_bytes=4096, prefetch=True, host_budget=None, stream=False)
        >>> out = runtime.run(spec, (x,), {})
    """

    def __init__(
        self, min_bytes: int, prefetch: bool, host_budget: int | None, stream: bool = False
    ) -> None:
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.host_budget = host_budget
        self.stream = stream  # Offload units stream (:mod:`gradckpt.engine.offload.stream`)
        self.session: OffloadSession | None = None

    def session_for(self, device: torch.device) -> OffloadSession:
        if self.session is None:
            if device.type == "cuda":
                from gradckpt.engine.offload.cuda import CudaOffloadBackend

                backend: Any = CudaOffloadBackend(device, host_budget=self.host_budget)
            else:
                backend = HostCopyBackend(host_budget=self.host_budget)
            self.session = OffloadSession(backend, min_bytes=self.min_bytes, prefetch=self.prefetch)
        return self.session

    def run(self, unit: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``unit``'s forward with its saved tensors offloaded."""
        module = unit.module
        keep = (*module.parameters(), *module.buffers())
        device = next((t.device for t in keep), None) or _first_device(args, kwargs)
        session = self.session_for(device)
        run = run_streamed if self.stream else run_offloaded
        return run(session, unit.path, unit.body or unit.plain, args, kwargs, keep)

    def run_boundary(
        self, unit: Any, args: tuple, kwargs: dict, arg: int, region: Callable[[], Any]
    ) -> Any:
        """Run ``region()`` (``unit``'s checkpointed region) with the input it keeps, the
        call's flat argument ``arg``, offloaded (:mod:`gradckpt.engine.offload.boundary`)."""
        boundary = boundary_argument(unit.path, args, kwargs, arg)
        keep = (*unit.module.parameters(), *unit.module.buffers())
        session = self.session_for(boundary.device)
        return run_boundary_offloaded(session, unit.path, region, boundary, keep)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "session": None}  # a copy starts its own session


def _first_device(args: tuple, kwargs: dict) -> torch.device:
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten((args, kwargs))
    return next((x.device for x in flat if isinstance(x, torch.Tensor)), torch.device("cpu"))

