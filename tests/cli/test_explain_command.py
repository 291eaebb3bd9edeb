"""``gradckpt explain --json``: its totals are what autograd keeps, measured independently.

The plain step's "bytes kept" must equal the bytes of the distinct storages that
autograd saves, seen through ``torch.autograd.graph.saved_tensors_hooks`` (deduped
by storage, counting only storages created during the step). Under a plan, the
kept total must shrink by exactly what the planned model no longer holds at the
end of its forward (measured with the live-storage tracker).
"""

from __future__ import annotations

import json

import torch

import gradckpt
from gradckpt.cli import main
from gradckpt.cli.targets import BUILTINS
from gradckpt.measure import MemoryTracker

from .conftest import assert_ok, gradckpt_cli


def _saved_bytes(model, loss_fn) -> int:
    """Bytes of distinct storages saved for backward and created during the step."""
    before = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, tuple[int, torch.Tensor]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in before:
            saved[storage._cdata] = (storage.nbytes(), t)  # holding t keeps _cdata unique
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    # the batch existed before the step: it is the loss_fn's closure, not a step storage
    for held in getattr(loss_fn, "__closure__", None) or ():
        inputs = held.cell_contents
        if isinstance(inputs, dict):
            for t in inputs.values():
                saved.pop(t.untyped_storage()._cdata, None)
    del loss
    return sum(n for n, _ in saved.values())


def _live_after_forward(model, loss_fn) -> int:
    torch.manual_seed(0)
    with MemoryTracker(model) as tracker:
        loss = loss_fn()
        live = tracker.live_created_bytes
    del loss
    return live


def test_explain_json_totals_equal_the_saved_storages(capsys):
    plain = gradckpt_cli("explain", "tiny-gpt", "--json", "--threads", "1", "--repeats", "1")
    assert_ok(plain)
    data = json.loads(plain.stdout)
    model, loss_fn = BUILTINS["tiny-gpt"].build(False, "cpu")
    assert data["totals"]["kept_bytes"] == _saved_bytes(model, loss_fn)
    assert data["totals"]["recomputed_bytes"] == 0
    storages = [r["storage"] for r in data["rows"]]
    assert len(storages) == len(set(storages))  # one row per storage
    assert data["peak"]["phase"] in ("forward", "backward")

    # The same command in-process (what the console script calls): one torch start-up less.
    assert main(["explain", "tiny-gpt", "--json", "--budget", "0.5", "--repeats", "1"]) == 0
    under = json.loads(capsys.readouterr().out)
    plan = gradckpt.Plan.from_json(under["plan"])
    assert under["totals"]["kept_bytes"] < data["totals"]["kept_bytes"]
    assert under["totals"]["recomputed_bytes"] > 0
    freed = data["totals"]["kept_bytes"] - under["totals"]["kept_bytes"]
    before = _live_after_forward(model, loss_fn)
    gradckpt.apply(model, plan)
    after = _live_after_forward(model, loss_fn)
    gradckpt.remove(model)
    assert before - after == freed
    statuses = {r["status"] for r in under["rows"]}
    assert "recomputed" in statuses and statuses <= {"kept", "region input", "selective",
                                                     "recomputed"}  # fmt: skip


def test_explain_text_groups_by_unit_and_ends_with_totals_and_peak(capsys):
    assert main(["explain", "tiny-gpt", "--budget", "0.6", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "blocks.0 (block): keeps" in text
    assert "op (producer)" in text and "why" in text
    assert "bytes kept for backward:" in text and "bytes recomputed in backward:" in text
    assert "peak " in text and "during the " in text
    assert text.index("blocks.0 (block)") < text.index("bytes kept for backward:")
