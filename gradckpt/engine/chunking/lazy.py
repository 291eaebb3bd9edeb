"""``LazyLogits``: what a chunked head returns instead of its logits.

A head chunked by a plan (``Chunk(k)`` on an LM head unit) does not compute its
``(..., V)`` logits. It returns a tensor that stands for them and holds only the
head's input: casts (``.float()``, ``.to(dtype)``), reshapes that keep the
vocabulary last (``.view(-1, V)``), ``.contiguous()``, indexing of the token
dimensions (``logits[:, :-1]``) and ``F.log_softmax(.., -1)`` give another such
tensor, and ``F.cross_entropy`` / ``F.nll_loss`` on it run
:func:`~gradckpt.engine.chunking.cross_entropy.chunked_cross_entropy`, so the
logits are never whole. ``flatten``, ``narrow``, ``select``,
``squeeze`` and ``unsqueeze`` of token dimensions too. A loss written against
plain logits (a Hugging Face model's ``ForCausalLMLoss``,
``F.cross_entropy(model(x).view(-1, V), y)``) runs chunked unchanged.

Anything else that reads it (``argmax`` for an accuracy, a z-loss's
``logsumexp``, printing) gets the logits computed whole, with autograd, and a
warning: the values are always right, only the memory the plan predicted is
not. An in-place op on it raises (it would have to change logits that do not
exist); a plan offers chunking only where the profiled step reads the logits
through the loss alone, so neither happens under a plan made for the step.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from gradckpt.engine.chunking.cross_entropy import chunked_cross_entropy
from gradckpt.engine.chunking.linear_loss import LinearHead

__all__ = ["HeadSource", "LazyLogits", "lazy_logits"]


class HeadSource:
    """The chunked head behind lazy logits: its call, slices, autocast and what it returns."""

    def __init__(
        self, head: Callable[[torch.Tensor], torch.Tensor], chunks: int, *, name: str = "head",
        autocast: tuple[str, torch.dtype] | None = None,
    ) -> None:  # fmt: skip
        self.head = head
        self.chunks = chunks
        self.name = name
        self.autocast = autocast
        self.warned = False

    def call(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.autocast is None:
            return self.head(hidden)
        with torch.autocast(self.autocast[0], dtype=self.autocast[1]):
            return self.head(hidden)

    def warn_whole(self, func: Any) -> None:
        if self.warned:
            return
        self.warned = True
        what = getattr(func, "__name__", repr(func))
        warnings.warn(
            f"gradckpt: the logits of {self.name}, chunked by the plan, were read by {what}; "
            "they are computed whole for it (the values are right), so this step's peak is not "
            "the plan's prediction. Read them under torch.no_grad() after the step, or plan "
            "with chunking=False.",
            stacklevel=4,
        )


def _autocast_state(device_type: str) -> tuple[str, torch.dtype] | None:
    if torch.is_autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def lazy_logits(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, chunks: int, *,
    name: str = "head",
) -> LazyLogits:  # fmt: skip
    """Lazy logits of ``head(hidden)``, to be consumed ``chunks`` slices of tokens at a time.

    The head runs once on one token now, to learn the vocabulary size and the
    logits' dtype (under the autocast state of this call, which the slices reuse).

    Example:
        >>> logits = lazy_logits(model.lm_head, h, 8)
        >>> loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
    """
    source = HeadSource(head, chunks, name=name, autocast=_autocast_state(hidden.device.type))
    # The probe's cast of the head's weight must not stay in autocast's cache until
    # the forward ends: the chunked loss makes its own, and two would be held.
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with torch.no_grad():
            probe = source.call(hidden.reshape(-1, hidden.shape[-1])[:1])
    finally:
        torch.set_autocast_cache_enabled(cache)
    wants_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in _parameters(head))
    )
    return LazyLogits(source, hidden, probe.shape[-1], probe.dtype, probe.dtype, wants_grad)


def _parameters(head: Any) -> list[torch.Tensor]:
    if isinstance(head, LinearHead):
        return [p for p in (head.weight, head.bias) if p is not None]
    plain = getattr(head, "plain", head)  # gradckpt's call of a unit's forward
    owner = getattr(plain, "__self__", plain)  # a bound forward: its module
    return list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []


class LazyLogits(torch.Tensor):
    """Logits ``head(hidden)`` not computed yet (see the module docstring)."""

    _source: HeadSource
    _hidden: torch.Tensor
    _head_dtype: torch.dtype  # the head's own dtype
    _log_softmax: bool
    _whole: torch.Tensor | None

    @staticmethod
    def __new__(
        cls, source: HeadSource, hidden: torch.Tensor, vocab: int, dtype: torch.dtype,
        base: torch.dtype, requires_grad: bool, log_softmax: bool = False,
    ) -> LazyLogits:  # fmt: skip
        shape = (*hidden.shape[:-1], vocab)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=hidden.device, requires_grad=requires_grad
        )
        self._source, self._hidden, self._head_dtype = source, hidden, base
        self._log_softmax, self._whole = log_softmax, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __repr__(self) -> str:  # no values: printing must not compute the logits
        return (
            f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, head={self._source.name}, "
            f"chunks={self._source.chunks})"
        )

    # ----------------------------------------------------------------- lazy views

    def _derived(self, hidden: torch.Tensor | None = None, **changes: Any) -> LazyLogits:
        return LazyLogits(
            self._source, self._hidden if hidden is None else hidden, self.shape[-1],
            changes.get("dtype", self.dtype), self._head_dtype, self.requires_grad,
            changes.get("log_softmax", self._log_softmax),
        )  # fmt: skip

    def whole(self) -> torch.Tensor:
        """The logits computed whole (with autograd), once; what any other read gets."""
        if self._whole is None:
            logits = self._source.call(self._hidden)
            if logits.dtype != self.dtype:
                logits = logits.to(self.dtype)
            self._whole = F.log_softmax(logits, dim=-1) if self._log_softmax else logits
        return self._whole

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        # Every Python-level use is answered in __torch_function__; reaching ATen means
        # something called an op below it (C++), where the logits cannot be made.
        raise RuntimeError(
            f"gradckpt: {func} reached the lazy logits of a chunked head below Python; "
            "plan with chunking=False for this model"
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        lazy = args[0] if args and isinstance(args[0], LazyLogits) else None
        rule = _RULES.get(func)
        if lazy is not None and rule is not None:
            result = rule(lazy, *args[1:], **kwargs)
            if result is not NotImplemented:
                return result
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE or "out" in kwargs:
            raise RuntimeError(
                f"gradckpt: {name or func} writes in place to the logits of "
                f"{_source_of(args).name}, which the plan chunks (they are never whole). Write "
                "it out of place (logits = logits / t), or plan with chunking=False."
            )
        for found in _lazies((args, kwargs)):
            found._source.warn_whole(func)

        def whole(x: Any) -> Any:
            return x.whole() if isinstance(x, LazyLogits) else x

        args, kwargs = tree_map(whole, (args, kwargs))
        return func(*args, **kwargs)


def _lazies(tree: Any) -> list[LazyLogits]:
    found: list[LazyLogits] = []
    tree_map(lambda x: found.append(x) if isinstance(x, LazyLogits) else None, tree)
    return found


def _source_of(args: tuple) -> HeadSource:
    return _lazies(args)[0]._source


# ----------------------------------------------------------------- the rules

_T = torch.Tensor
_METADATA = {
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__, _T.layout.__get__,
    _T.requires_grad.__get__, _T.is_leaf.__get__, _T.grad_fn.__get__, _T.is_cuda.__get__,
    _T.is_meta.__get__, _T.is_sparse.__get__, _T.is_quantized.__get__, _T.size, _T.dim,
    _T.numel, _T.nelement, _T.element_size, _T.is_floating_point, _T.is_complex, _T.__len__,
    _T.get_device,
}  # fmt: skip
_IN_PLACE = {
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__ipow__", "__iand__", "__ior__", "__ixor__",
}  # fmt: skip


def _cast(lazy: LazyLogits, dtype: torch.dtype) -> LazyLogits:
    return lazy if dtype == lazy.dtype else lazy._derived(dtype=dtype)


def _to(lazy: LazyLogits, *args: Any, **kwargs: Any) -> Any:
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if (device is not None and torch.device(device) != lazy.device) or kwargs.get("copy"):
        return NotImplemented
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        return NotImplemented
    return _cast(lazy, dtype or lazy.dtype)


def _reshape(lazy: LazyLogits, *shape: Any) -> Any:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    try:
        new = torch.empty(lazy.shape, device="meta").view(*shape).shape
    except RuntimeError:
        return NotImplemented
    if not new or new[-1] != lazy.shape[-1]:
        return NotImplemented  # the vocabulary must stay the last dimension, whole
    return lazy._derived(lazy._hidden.reshape(*new[:-1], lazy._hidden.shape[-1]))


def _dims_used(index: tuple) -> int | None:
    """How many dimensions ``index`` consumes (None: a form not handled lazily)."""
    used = 0
    for i in index:
        if i is None or isinstance(i, bool):
            return None  # new axes and boolean scalars reshape the result
        if isinstance(i, torch.Tensor):
            used += i.ndim if i.dtype == torch.bool else 1
        elif i is not Ellipsis:
            used += 1
    return used


def _getitem(lazy: LazyLogits, index: Any) -> Any:
    index = index if isinstance(index, tuple) else (index,)
    used = _dims_used(index)
    if used is None:
        return NotImplemented
    last = index[-1] if index else None
    if any(i is Ellipsis for i in index) or used == lazy.ndim:
        # the vocabulary dimension is indexed explicitly: only a whole ``:`` keeps it
        keeps = isinstance(last, slice) and last == slice(None)
    else:
        keeps = used < lazy.ndim
    if not keeps:
        return NotImplemented
    return lazy._derived(lazy._hidden[index])


def _token_view(func: Any) -> Callable[..., Any]:
    """A rule for ``func`` (flatten, narrow, squeeze, ...): lazy when, applied to the logits'
    shape and to the head's input alike, it leaves the last dimension alone."""

    def rule(lazy: LazyLogits, *args: Any, **kwargs: Any) -> Any:
        try:
            shape = func(torch.empty(lazy.shape, device="meta"), *args, **kwargs).shape
            hidden = func(lazy._hidden, *args, **kwargs)
        except (RuntimeError, IndexError, TypeError, ValueError):
            return NotImplemented
        last = lazy._hidden.shape[-1]
        if not shape or shape[-1] != lazy.shape[-1] or tuple(hidden.shape) != (*shape[:-1], last):
            return NotImplemented
        return lazy._derived(hidden)

    return rule


def _log_softmax(lazy: LazyLogits, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> Any:
    if lazy._log_softmax or dim not in (-1, lazy.ndim - 1):
        return NotImplemented
    return lazy._derived(log_softmax=True, dtype=dtype or lazy.dtype)


_CE = inspect.signature(F.cross_entropy)
_NLL = inspect.signature(F.nll_loss)


def _loss(lazy: LazyLogits, signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    bound = signature.bind(lazy, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    target = a["target"]
    plain = a["weight"] is None and a["size_average"] is None and a["reduce"] is None
    if not plain or lazy.ndim != 2 or not isinstance(target, torch.Tensor):
        return NotImplemented  # class weights, legacy arguments, classes not last
    if target.shape != lazy.shape[:-1] or target.is_floating_point():
        return NotImplemented  # class probabilities as targets
    source = lazy._source
    return chunked_cross_entropy(
        lazy._hidden, source.head, target, chunks=source.chunks, ignore_index=a["ignore_index"],
        label_smoothing=a.get("label_smoothing", 0.0), reduction=a["reduction"],
        upcast=None if lazy.dtype == lazy._head_dtype else lazy.dtype, autocast=source.autocast,
    )  # fmt: skip


def _cross_entropy(lazy: LazyLogits, *args: Any, **kwargs: Any) -> Any:
    if lazy._log_softmax:
        return NotImplemented
    return _loss(lazy, _CE, args, kwargs)


def _nll_loss(lazy: LazyLogits, *args: Any, **kwargs: Any) -> Any:
    if not lazy._log_softmax:
        return NotImplemented
    # cross-entropy is log-softmax then NLL: the same chunked loss
    return _loss(lazy, _NLL, args, kwargs)


_RULES: dict[Any, Callable[..., Any]] = {
    _T.float: lambda lazy: _cast(lazy, torch.float32),
    _T.double: lambda lazy: _cast(lazy, torch.float64),
    _T.half: lambda lazy: _cast(lazy, torch.float16),
    _T.bfloat16: lambda lazy: _cast(lazy, torch.bfloat16),
    _T.to: _to,
    _T.type_as: lambda lazy, other: (
        _to(lazy, other.dtype) if other.device == lazy.device else NotImplemented
    ),
    _T.view: _reshape,
    _T.reshape: _reshape,
    _T.contiguous: lambda lazy, memory_format=torch.contiguous_format: lazy,
    _T.__getitem__: _getitem,
    _T.flatten: _token_view(_T.flatten),
    torch.flatten: _token_view(torch.flatten),
    _T.narrow: _token_view(_T.narrow),
    _T.select: _token_view(_T.select),
    _T.squeeze: _token_view(_T.squeeze),
    _T.unsqueeze: _token_view(_T.unsqueeze),
    F.log_softmax: _log_softmax,
    F.cross_entropy: _cross_entropy,
    F.nll_loss: _nll_loss,
}
