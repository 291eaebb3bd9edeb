"""A profile at a new sequence length without running anything: rescale one measured at others.

In a transformer step every storage's bytes and every op's FLOPs are a product
of dimensions, which are constants or affine in the sequence length ``n`` (``n``,
``n + 1`` for shifted labels; twice for attention scores), so each is a
polynomial of degree at most 2 in ``n``. The polynomial is fitted exactly
(rational arithmetic) through three profiles at distinct lengths and must then
hit every further profile exactly (at least one more: the check). When all the
profiles have the same event line (same ops, storages, saves and frees in the
same order) and every value passes, the profile at another length is those
polynomials evaluated there. Anything else (a different event line, a value of
higher degree, a fractional result) is refused and the caller profiles for real.

Tests check the rescaled profile against a fake-tensor profile at unseen lengths
(every storage's bytes, every op's FLOPs and the simulated peak of plans) for
GPT-2 and Llama. Op times are re-estimated from FLOPs and bytes, which is what a
fake profile does too.

Example:
    >>> scaling = fit_length_scaling({64: p64, 96: p96, 128: p128, 160: p160})
    >>> profile_at_200 = scaling.at(200)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from gradckpt.planning.plans.planset import same_event_line
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.solvers import none_plan
from gradckpt.profiling.fake import SPEEDS, estimate_time
from gradckpt.profiling.records import Profile

__all__ = ["LengthScaling", "fit_length_scaling", "with_measured_workspace"]

Poly = tuple[Fraction, Fraction, Fraction]  # a + b*n + c*n**2


def _fit(points: list[tuple[int, int]]) -> Poly | None:
    """The polynomial of degree <= 2 through the first three points, if it hits all of them."""
    (x0, y0), (x1, y1), (x2, y2) = points[:3]
    if y0 == y1 == y2:
        poly: Poly = (Fraction(y0), Fraction(0), Fraction(0))
    else:
        # Newton's divided differences, exact.
        d01 = Fraction(y1 - y0, x1 - x0)
        d12 = Fraction(y2 - y1, x2 - x1)
        c = (d12 - d01) / (x2 - x0)
        b = d01 - c * (x0 + x1)
        a = y0 - b * x0 - c * x0 * x0
        poly = (a, b, c)
    if any(_value(poly, x) != y for x, y in points):
        return None
    return poly


def _value(poly: Poly, n: int) -> Fraction:
    a, b, c = poly
    return a + b * n + c * n * n


def _whole(poly: Poly, n: int) -> int | None:
    v = _value(poly, n)
    return int(v) if v.denominator == 1 and v >= 0 else None


@dataclass(frozen=True)
class LengthScaling:
    """Per storage and op, its bytes / FLOPs as a polynomial in the length."""

    base: Profile
    lengths: tuple[int, ...]
    bytes_at: tuple[Poly, ...]
    flops_at: tuple[Poly, ...]

    def at(self, length: int) -> Profile | None:
        """The profile at ``length``, or None if a value would not be a whole number."""
        storages = []
        for s, poly in zip(self.base.storages, self.bytes_at):
            nbytes = _whole(poly, length)
            if nbytes is None:
                return None
            storages.append(replace(s, nbytes=nbytes))
        speed = SPEEDS.get(self.base.device, SPEEDS["cuda"])
        ops = []
        for op, poly in zip(self.base.ops, self.flops_at):
            flops = _whole(poly, length)
            if flops is None:
                return None
            written = sum(storages[i].nbytes for i in op.outputs)
            time = estimate_time(flops, written, speed, self.base.host_op_seconds)
            ops.append(replace(op, flops=flops, time=time))
        units = tuple(
            replace(
                u,
                fwd_time=sum(op.time for op in ops if op.unit == u.index and not op.backward),
                bwd_time=sum(op.time for op in ops if op.unit == u.index and op.backward),
            )
            for u in self.base.units
        )
        scaled = replace(
            self.base,
            storages=tuple(storages),
            ops=tuple(ops),
            units=units,
            step_time=sum(op.time for op in ops),
            input_shapes=(),
            sub_calls=(),  # no shapes to slice MLPs by (see docs/chunking.md)
        )
        # The plain peak is the simulated peak of keeping everything (the simulator
        # reproduces a profile's measured peak exactly).
        plain = simulate(scaled, none_plan(scaled)).peak_bytes
        return replace(scaled, measured_peak_bytes=plain)


def fit_length_scaling(profiles: Mapping[int, Profile]) -> LengthScaling | None:
    """A :class:`LengthScaling` from fake profiles at four or more lengths, or None.

    None when the profiles' event lines differ or some storage's bytes or op's
    FLOPs are not one polynomial of degree <= 2 in the length at all of them.
    """
    if len(profiles) < 4 or not all(p.fake for p in profiles.values()):
        return None
    lengths = sorted(profiles)
    base = profiles[lengths[0]]
    if not all(same_event_line(base, profiles[n]) for n in lengths[1:]):
        return None
    bytes_at = []
    for i in range(len(base.storages)):
        poly = _fit([(n, profiles[n].storages[i].nbytes) for n in lengths])
        if poly is None:
            return None
        bytes_at.append(poly)
    flops_at = []
    for i in range(len(base.ops)):
        poly = _fit([(n, profiles[n].ops[i].flops) for n in lengths])
        if poly is None:
            return None
        flops_at.append(poly)
    return LengthScaling(base, tuple(lengths), tuple(bytes_at), tuple(flops_at))


def with_measured_workspace(prof: Profile, measured: Profile | None) -> Profile:
    """A fake (or rescaled) ``prof`` with each op's kernel workspace taken from ``measured``.

    Fake tensors run no kernels, so a fake profile has no workspace (convolution
    backward's columns: several percent of a conv model's peak). ``measured`` is a
    real profile of the same model at another shape (the one ``fit`` measured at
    the allocator). Ops are matched by kind: the k-th op of a name (forward or
    backward) in ``prof`` is the k-th in ``measured`` when both have as many of
    that name (the losses may differ: ``loss_from`` is not ``loss_fn``). Each
    matched op's workspace is scaled by how much its largest output or its FLOPs
    grew (workspace follows the size of the data the kernel works on).
    """
    if measured is None or not prof.fake or measured.peak_level != "allocator":
        return prof
    if not any(o.workspace for o in measured.ops):
        return prof
    ours, theirs = _by_kind(prof), _by_kind(measured)
    twin = {}
    for kind, indices in ours.items():
        if len(theirs.get(kind, ())) == len(indices):
            twin.update(zip(indices, theirs[kind]))
    ops = []
    for op in prof.ops:
        ref = measured.ops[twin[op.index]] if op.index in twin else None
        if ref is None or not ref.workspace or len(ref.outputs) != len(op.outputs):
            ops.append(op)
            continue
        grown = [
            Fraction(prof.storages[a].nbytes, measured.storages[b].nbytes)
            for a, b in zip(op.outputs, ref.outputs)
            if measured.storages[b].nbytes
        ]
        if ref.flops and op.flops:  # a weight gradient's size stays, the work behind it grows
            grown.append(Fraction(op.flops, ref.flops))
        scaled = ref.workspace * max(grown, default=Fraction(1))
        ops.append(replace(op, workspace=-(-scaled.numerator // scaled.denominator)))
    with_ws = replace(prof, ops=tuple(ops))
    return replace(with_ws, measured_peak_bytes=simulate(with_ws, none_plan(with_ws)).peak_bytes)


def _by_kind(prof: Profile) -> dict[tuple[str, bool], list[int]]:
    kinds: dict[tuple[str, bool], list[int]] = {}
    for op in prof.ops:
        kinds.setdefault((op.name, op.backward), []).append(op.index)
    return kinds
