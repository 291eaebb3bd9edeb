"""Moved to :mod:`gradckpt.integrations.hf.tune`; this path is kept for one release."""

from gradckpt.integrations.hf.tune import tune_training_args

__all__ = ["tune_training_args"]
