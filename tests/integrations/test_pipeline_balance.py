"""The split points chosen so the planned stages balance (``balance_partition``, #43 item 3).

A decoder whose head is heavy (a vocabulary of 2,048 on d 32: the head costs
about as much as several blocks) split in two stages under 1F1B, planned under
fake tensors (op times from FLOPs and bytes: the same answer on every machine).
"""

from __future__ import annotations

import pytest
import torch

from gradckpt.integrations.pipeline_balance import balance_partition, even_split
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.testing.pipelines import gpt_stages, next_token_loss

LAYERS, STAGES, M = 4, 2, 4
CONFIG = dict(d_model=32, heads=2, seq=32, vocab=2048)


def _build(stage: int, blocks: int):
    per_stage = list(even_split(LAYERS - blocks, STAGES - 1))
    per_stage.insert(stage, blocks)
    module = gpt_stages(STAGES, layers=LAYERS, per_stage=per_stage, **CONFIG)[stage]
    x = torch.randint(0, CONFIG["vocab"], (2, CONFIG["seq"]))
    inputs = (x,) if stage == 0 else (torch.randn(2, CONFIG["seq"], CONFIG["d_model"]),)
    return module, inputs


def _balance(budget):
    y = torch.randint(0, CONFIG["vocab"], (2, CONFIG["seq"]))
    return balance_partition(_build, LAYERS, STAGES, "1f1b", budget, n_microbatches=M,
                             loss=next_token_loss, target=y, optimizer="adamw", fake=True)  # fmt: skip


def test_even_split_puts_the_extra_blocks_first():
    assert even_split(10, 4) == (3, 3, 2, 2)
    assert even_split(8, 2) == (4, 4)


def test_the_balanced_split_gives_the_head_heavy_last_stage_fewer_blocks():
    torch.set_num_threads(1)
    found = _balance(1 << 40)
    assert sum(found.best.per_stage) == LAYERS and min(found.best.per_stage) >= 1
    assert found.even is not None and found.even.per_stage == (2, 2)
    assert found.best.per_stage[-1] < 2  # the head's stage takes fewer blocks
    assert found.gain is not None and found.gain > 1.05
    times = [p.time_per_microbatch for p in found.best.plans]
    assert found.best.step_time == pytest.approx((M + STAGES - 1) * max(times))
    assert "predicted gain" in found.describe()
    # The head's stage holds the most (its logits); at the balanced last stage's peak, the
    # even split's (one more block) fits no plan, the balanced one does.
    budget = found.best.plans[-1].predicted_peak_bytes
    tight = _balance(budget)
    assert tight.even is None and tight.gain is None
    assert all(p.predicted_peak_bytes <= budget for p in tight.best.plans)
    assert "the even split fits no plan" in tight.describe()
    with pytest.raises(BudgetError, match="no split of 4 blocks into 2 stages"):
        _balance(1 << 16)
