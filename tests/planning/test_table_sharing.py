"""Identical blocks share the DP's tables: a count of distinct cells, not a time.

A chain of N identical blocks has about 3N distinct nested cells when blocks
share (cells by length, plus those touching a differing first or last stage),
and N^2/2 when any per-block difference (e.g. state counted against later
blocks, growing block by block) makes every stage unique. The bound below
sits between the two from N = 16 on.
"""

from __future__ import annotations

import pytest

import gradckpt
from gradckpt.planning.solving.chain import build_chain
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.testing import make

_SIZES = {
    "mlp": {"width": 16, "hidden": 32, "batch": 8},
    "gpt": {"d_model": 16, "heads": 2, "seq": 8, "vocab": 32, "batch": 2},
}


def _chain(kind: str, blocks: int):
    depth = {"layers": blocks} if kind == "gpt" else {"blocks": blocks}
    ex = make(kind, **depth, **_SIZES[kind])
    prof = gradckpt.profile(ex.model, ex.loss_fn, fake=True)
    assert prof.device == "cpu"  # where each region keeps an RNG state in the allocator
    return build_chain(prof)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_identical_blocks_get_identical_stages_and_share_cells(kind):
    for blocks in (16, 32):
        model = _chain(kind, blocks)
        stages = model.chain.stages
        is_block = [u.is_block for u in model.units]
        inner = [i for i in range(1, len(stages) - 1) if all(is_block[i - 1 : i + 2])]
        assert len(inner) == blocks - 2
        # Interior blocks are one stage, option by option (requirements in bytes).
        assert len({stages[i] for i in inner}) == 1, "interior blocks' stages differ"
        cells = ChainDP(model.chain)._cells.cells
        # Shared: O(N); unshared it would be ~N^2/2 (136 at 16, 528 at 32 blocks).
        assert cells <= 4 * len(stages), (blocks, cells)
