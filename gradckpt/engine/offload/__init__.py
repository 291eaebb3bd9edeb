"""The offload engine: a unit's saved tensors go to host memory and come back in backward.

One module per concern:

* :mod:`~gradckpt.engine.offload.session`: *what* moves and *when* (the
  saved-tensor hooks of one unit call, the one-deep forward stash, the prefetch);
* :mod:`~gradckpt.engine.offload.store`: *how* bytes leave the compute pool
  (the backend interface and the host-copy backend that runs on any CPU);
* :mod:`~gradckpt.engine.offload.cuda`: the pinned-pool CUDA backend (imported
  only when a unit runs on a CUDA device);
* :mod:`~gradckpt.engine.offload.boundary`: a recomputed region's kept input
  moved the same way (``RecomputeOffload``);
* :mod:`~gradckpt.engine.offload.runtime`: one session per applied model, shared
  by its offloaded units.

The names below were the module ``gradckpt.engine.offload``'s before it became
this package, so ``from gradckpt.engine.offload import ...`` keeps working.
"""

from gradckpt.engine.offload.boundary import run_boundary_offloaded
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.engine.offload.session import (
    CreatedStorages,
    OffloadGroup,
    OffloadSession,
    run_offloaded,
    storage_key,
)
from gradckpt.engine.offload.store import HostCopyBackend, HostOverBudgetError, OffloadBackend

__all__ = [
    "CreatedStorages",
    "HostCopyBackend",
    "HostOverBudgetError",
    "OffloadBackend",
    "OffloadGroup",
    "OffloadRuntime",
    "OffloadSession",
    "run_boundary_offloaded",
    "run_offloaded",
    "storage_key",
]
