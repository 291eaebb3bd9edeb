"""gradckpt: gradient (activation) checkpointing for PyTorch that plans itself."""

from gradckpt import policies
from gradckpt.engine import (
    RECOMPUTE,
    SAVE,
    CheckpointError,
    Decision,
    PolicyContext,
    checkpoint,
    checkpoint_sequential,
    tag,
)

__version__ = "0.1.0"

__all__ = [
    "RECOMPUTE",
    "SAVE",
    "CheckpointError",
    "Decision",
    "PolicyContext",
    "__version__",
    "checkpoint",
    "checkpoint_sequential",
    "policies",
    "tag",
]
