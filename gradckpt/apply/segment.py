"""A planned segment's region: one region over several units' calls, and its replay.

The segment opens when its first unit is called inside the model's forward and
closes after its last unit; in between, each unit call is recorded (its
non-chain arguments and where the previous unit's output goes) so that the
recompute can call the units again, as modules, hooks included.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradckpt.apply.calls import replaying
from gradckpt.apply.specs import SegmentSpec, UnitSpec, call_in_region, fsdp_sharded, segment_error
from gradckpt.engine.frame import Frame
from gradckpt.engine.handoffs import Handoffs
from gradckpt.engine.holders import CheckpointError

__all__ = ["SegmentFrame", "open_segment", "run_segment_start"]


class SegmentFrame(Frame):
    """A segment's region: records each unit call so its recompute can replay them."""

    def __init__(self, spec: SegmentSpec, units: dict[str, UnitSpec]) -> None:
        members = [units[p] for p in spec.paths]
        for unit in members:
            sharded = fsdp_sharded(unit.module)
            if sharded is not None:
                raise CheckpointError(
                    segment_error(spec.name, ".".join(x for x in (unit.path, sharded) if x))
                )
        super().__init__(
            None,
            name=spec.name,
            compiled=any(u.body is not None for u in members),
            state=lambda: [u.module for u in members],
        )
        self.segment = spec
        self.units = units
        self.handoffs = Handoffs()  # .data edits between units: checked before the recompute
        self.calls: list[tuple[list[Any], Any, int]] = []  # flat args, spec, chain position
        self._last_output: weakref.ref | None = None
        self._last_version = 0
        # A forward hook may replace a unit's output: the next unit's chain input is
        # what the hooks returned, so note it after them (the last unit's hooks run
        # after the segment closed).
        self._output_hooks = [
            module.register_forward_hook(self._note_hooked_output)
            for module in _distinct(u.module for u in members[:-1])
            if module._forward_hooks or nn.modules.module._global_forward_hooks
        ]
        # Likewise a pre-hook may replace a unit's inputs: record them before the
        # pre-hooks run, and the replay (which calls the module) runs them again.
        self._raw_inputs: dict[int, tuple[list[Any], Any, list[int]]] = {}
        self._output_hooks += [
            module.register_forward_pre_hook(self._note_raw_inputs, prepend=True, with_kwargs=True)
            for module in _distinct(u.module for u in members[1:])
            if module._forward_pre_hooks or nn.modules.module._global_forward_pre_hooks
        ]

    def _note_raw_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._exit is not None:
            flat, tree = tree_flatten((args, kwargs))
            versions = [x._version if isinstance(x, torch.Tensor) else 0 for x in flat]
            self._raw_inputs[id(module)] = (flat, tree, versions)
            # What arrives is what the pre-hooks get: the replay runs them again.
            last = self._last_output() if self._last_output is not None else None
            path = next((p for p in self.segment.paths if self.units[p].module is module), "")
            chain = next((x for x in flat if last is not None and x is last), None)
            if chain is not None:
                self.handoffs.arrived(chain, path)

    def _note_hooked_output(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._exit is not None:  # still the segment's forward
            self.note_output(out)

    def end(self, exc: BaseException | None = None) -> None:
        for handle in self._output_hooks:
            handle.remove()
        self._output_hooks = []
        super().end(exc)

    def record(self, spec_path: str, flat: list[Any], tree: Any) -> None:
        expected = (
            self.segment.paths[len(self.calls)]
            if len(self.calls) < len(self.segment.paths)
            else None
        )
        if spec_path != expected:
            raise CheckpointError(
                f"gradckpt: {spec_path} ran inside {self.segment.name}, where {expected} was "
                "planned next; the forward does not call the units in the planned order. "
                "Plan the model again."
            )
        # Keep what the replay needs but no activation made inside the segment:
        # the first call's tensors are the frame's saved inputs, and each later
        # call's chain input is the previous unit's replayed output.
        if not self.calls:
            self.calls.append(([None] * len(flat), tree, -1))
            return
        versions = [x._version if isinstance(x, torch.Tensor) else 0 for x in flat]
        raw = self._raw_inputs.pop(id(self.units[spec_path].module), None)
        if raw is not None:  # the inputs as they were before the unit's pre-hooks
            flat, tree, versions = raw
        last = self._last_output() if self._last_output is not None else None
        for i, x in enumerate(flat):
            if last is not None and x is last:
                if versions[i] != self._last_version:
                    # The replay hands the output straight to the next unit: code
                    # between them (an in-place edit) would not run again.
                    raise CheckpointError(
                        f"gradckpt: the forward changed the output of the unit before "
                        f"{spec_path} in place between the two units, inside "
                        f"{self.segment.name}; its recompute would not repeat that edit. "
                        "The plan was made for a forward without it: plan the model again "
                        "(no segment will span the edit)."
                    )
                self.handoffs.arrived(x, spec_path)
                kept = list(flat)
                kept[i] = None
                self.calls.append((kept, tree, i))
                return
        raise CheckpointError(
            f"gradckpt: {spec_path} did not receive the output of the unit before it, so "
            f"{self.segment.name} cannot be recomputed as one region. The plan was made for "
            "a forward that chains these units; plan the model again."
        )

    def note_output(self, out: Any) -> None:
        flat, _ = tree_flatten(out)
        first = next((x for x in flat if isinstance(x, torch.Tensor)), None)
        self._last_output = weakref.ref(first) if first is not None else None
        self._last_version = first._version if first is not None else 0
        self.handoffs.left(first)

    def run_body(self, inputs: list[Any]) -> None:
        # Each unit is called as a module, so its hooks run as in the forward
        # (also hooks registered after apply), except those that ran outside the
        # region: the first unit's pre-hooks (the saved inputs already passed
        # them) and the last unit's forward hooks (they ran after it closed).
        previous = None
        last = len(self.calls) - 1
        for i, (path, (flat, tree, chain_at)) in enumerate(zip(self.segment.paths, self.calls)):
            args = list(inputs) if chain_at < 0 else list(flat)
            if chain_at >= 0:
                args[chain_at] = previous
            call_args, call_kwargs = tree_unflatten(args, tree)
            module = self.units[path].module
            # A shared module's call is named: the replay runs the unit it was.
            with _hooks_skipped(module, pre=i == 0, post=i == last), replaying(path):
                out = module(*call_args, **call_kwargs)
            flat_out, _ = tree_flatten(out)
            previous = next((x for x in flat_out if isinstance(x, torch.Tensor)), None)


def _distinct(modules: Iterator[nn.Module]) -> list[nn.Module]:
    """Each module once (a shared module's calls may be several units of one segment)."""
    return list({id(m): m for m in modules}.values())


@contextlib.contextmanager
def _hooks_skipped(module: nn.Module, *, pre: bool, post: bool) -> Iterator[None]:
    """Call ``module`` without its own forward pre-hooks (``pre``) or forward hooks (``post``)."""
    saved = {}
    for name, skip in (("_forward_pre_hooks", pre), ("_forward_hooks", post)):
        if skip and getattr(module, name):
            saved[name] = module.__dict__[name]
            module.__dict__[name] = type(saved[name])()
    try:
        yield
    finally:
        module.__dict__.update(saved)


def open_segment(top: tuple[Frame, int | None] | None) -> SegmentFrame | None:
    if top is not None and top[1] is None and isinstance(top[0], SegmentFrame):
        return top[0]
    return None


def run_segment_start(
    spec: SegmentSpec, unit: UnitSpec, units: dict[str, UnitSpec], args: tuple, kwargs: dict
) -> Any:
    frame = SegmentFrame(spec, units)
    flat, tree = tree_flatten((args, kwargs))
    frame.save_inputs(flat)
    frame.begin()
    frame.record(unit.path, flat, tree)
    try:
        out = call_in_region(unit, args, kwargs)
    except BaseException as exc:
        frame.end(exc)
        raise
    frame.note_output(out)
    return out
