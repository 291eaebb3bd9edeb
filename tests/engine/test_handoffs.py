""".data edits between the units of a segment are refused, never wrong gradients (issue 28, item 7).

A segment's recompute hands each unit the previous unit's recomputed output;
code between the units does not run again. ``x.mul_`` there bumps the version
counter and was already refused; ``x.data.mul_`` and ``x.data = y`` do not, and
gave gradients off by up to 0.18 on this model with no error.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine.handoffs import Handoffs, bits_checksum
from gradckpt.measure.allocator import AllocatorTracker
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.profiling import model_fingerprint

Edit = Callable[[torch.Tensor], None]


class Net(nn.Module):
    """Four blocks; ``edit`` runs on block 1's output before block 2 gets it."""

    def __init__(self, edit: Edit | None = None, inside: Edit | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 16))
            for _ in range(4)
        )
        self.edit = edit
        if inside is not None:
            self.blocks[2].register_forward_pre_hook(lambda m, args: inside(args[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1 and self.edit is not None:
                self.edit(x)
        return x


def _grads(edit: Edit | None, segment: bool, inside: Edit | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model, x = Net(edit, inside), torch.randn(8, 16)
    if segment:
        units = tuple(UnitChoice(f"blocks.{i}") for i in range(4))
        gradckpt.apply(model, Plan((Segment(units),), model_fingerprint(model)))
    torch.manual_seed(1)  # dropout on: the same masks in both runs
    model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def _scale_data(x: torch.Tensor) -> None:
    x.data.mul_(0.5)


def _replace_data(x: torch.Tensor) -> None:
    x.data = x.data * 0.5


@pytest.mark.parametrize("edit", [_scale_data, _replace_data], ids=["data.mul_", "data="])
def test_an_edit_through_data_between_units_is_refused_naming_the_unit(edit):
    # Old code: no error, gradients off by up to 0.18 (atol 1e-2 fails).
    with pytest.raises(gradckpt.CheckpointError, match=r"before blocks\.2.*\.data"):
        _grads(edit, segment=True)


def test_an_ordinary_in_place_edit_between_units_is_still_refused():
    def scale(x: torch.Tensor) -> None:
        x.mul_(0.5)

    with pytest.raises(gradckpt.CheckpointError, match="in place between the two units"):
        _grads(scale, segment=True)


def test_without_edits_and_with_an_edit_the_recompute_repeats_the_gradients_are_exact():
    for kwargs in ({"edit": None}, {"edit": None, "inside": _scale_data}):
        plain = _grads(segment=False, **kwargs)
        planned = _grads(segment=True, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(plain, planned))


def test_the_profile_sees_the_edit_so_a_new_plan_spans_no_segment_over_it():
    torch.manual_seed(0)
    model, x = Net(_scale_data), torch.randn(8, 16)
    blocks = [f"blocks.{i}" for i in range(4)]
    prof = gradckpt.profile(model, lambda: model(x).square().sum(), repeats=1, blocks=blocks)
    chained = {u.path: u.chained for u in prof.units if u.path in blocks}
    assert chained["blocks.1"] and chained["blocks.3"]
    assert not chained["blocks.2"]  # the edit's op runs between blocks.1 and blocks.2


def test_bits_checksum_is_exact_and_sees_any_change():
    x = torch.randn(64, 32)
    assert bits_checksum(x) == bits_checksum(x.clone())
    for edited in (x * 0.5, x * 2, x + 1, x.index_put((torch.tensor([3]),), torch.tensor(0.0))):
        assert bits_checksum(x) != bits_checksum(edited)  # x * 0.5 wraps the bit sum alone
    half = x.bfloat16()
    assert bits_checksum(half) != bits_checksum(half * 0.5)
    nan = torch.full((4,), float("nan"))
    assert bits_checksum(nan) == bits_checksum(nan.clone())  # NaN != NaN, bits equal
    for t in (x.t(), x.bfloat16(), x > 0, torch.randn(3, dtype=torch.complex64), x.double()):
        assert isinstance(bits_checksum(t), tuple)  # a CPU tensor's sums are read: nothing stays
        assert bits_checksum(t) == bits_checksum(t)  # the same tensor always sums the same
        assert bits_checksum(t)[0] == bits_checksum(t.contiguous())[0]  # bits: any layout
    assert bits_checksum(torch.empty(3, device="meta")) is None


def test_bits_checksum_allocates_no_copy_of_the_tensor():
    """Summing into a wider integer type made torch convert the whole tensor first:
    an int64 copy, twice an fp32 activation and four times a bf16 one."""
    for t in (torch.randn(1 << 16), torch.randn(1 << 16).bfloat16(), torch.randn(256, 256).t()):
        with AllocatorTracker() as allocator:
            bits_checksum(t)
        assert allocator.peak_bytes <= 64, (t.dtype, allocator.peak_bytes)
        assert allocator.end_bytes == 0


def test_handoffs_compare_only_what_the_forward_handed_over():
    y = torch.randn(10)
    handoffs = Handoffs()
    handoffs.left(y)
    handoffs.arrived(y, "b1")
    handoffs.check("seg")  # unchanged: no error, and checked again on a later pass
    handoffs.check("seg")
    handoffs.left(y)
    y.data.add_(1)
    handoffs.arrived(y, "b2")
    with pytest.raises(gradckpt.CheckpointError, match="before b2"):
        handoffs.check("seg")
