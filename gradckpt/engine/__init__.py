"""Layer 1: the recompute mechanism (non-reentrant, on ``saved_tensors_hooks``)."""

from gradckpt.engine.checkpoint import checkpoint, checkpoint_sequential
from gradckpt.engine.chunking import chunked_cross_entropy
from gradckpt.engine.decisions import (
    RECOMPUTE,
    SAVE,
    TAG,
    Chunk,
    Decision,
    Keep,
    Offload,
    PolicyContext,
    Recompute,
    RecomputeOffload,
    Selective,
)
from gradckpt.engine.frame import Frame, tag
from gradckpt.engine.holders import CheckpointError, active_frame, in_region_forward
from gradckpt.engine.modes import counts_as_op

__all__ = [
    "RECOMPUTE",
    "SAVE",
    "TAG",
    "CheckpointError",
    "Chunk",
    "Decision",
    "Frame",
    "Keep",
    "Offload",
    "PolicyContext",
    "Recompute",
    "RecomputeOffload",
    "Selective",
    "active_frame",
    "checkpoint",
    "checkpoint_sequential",
    "chunked_cross_entropy",
    "counts_as_op",
    "in_region_forward",
    "tag",
]
