"""Moved to :mod:`gradckpt.integrations.hf.trainer`; this path is kept for one release."""

from gradckpt.integrations.hf.trainer import BudgetCallback

__all__ = ["BudgetCallback"]
