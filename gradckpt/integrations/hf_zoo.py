"""Moved to :mod:`gradckpt.integrations.hf.zoo`; this path is kept for one release."""

from gradckpt.integrations.hf.zoo import HF_MODELS, Step, hf_example, run_step

__all__ = ["HF_MODELS", "Step", "hf_example", "run_step"]
