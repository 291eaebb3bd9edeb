"""Which modules of a model are *units*: the pieces a plan may checkpoint.

Blocks are the repeated layers (decoder layers, residual blocks). They are
found automatically — by the adapter an integration registered for its library
(:mod:`gradckpt.profiling.adapters`, or :func:`register_block_finder`), Hugging Face
``GradientCheckpointingLayer``s, or classes that repeat among the children of
*containers* — or given by the user. A container is an ``nn.ModuleList``,
``nn.Sequential`` or ``nn.ModuleDict``, or a plain module used as one: its children
all of one class and named as a numbered sequence (timm's RegNet keeps blocks
``b1``, ``b2``, ... as attributes of plain stage modules, stages in stages
included). A plain module whose children differ (a residual block's ``conv1``,
``conv2``, ``se``, ``act``) is not a container, so its parts never split it; one
whose only parts are ``conv1`` and ``conv2`` of one class would be (name its
blocks with ``blocks=`` then). Every other maximal submodule that holds no block
(embeddings, final norm, head) is a unit too, so what lies between blocks is
planned as well. When none is found, :func:`blocks_not_found` says what was
considered; the profile keeps it for the error of a budget no plan meets.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from gradckpt.profiling.adapters import Adapter, register_adapter, registered_blocks

__all__ = [
    "Unit",
    "block_candidates",
    "blocks_not_found",
    "call_path",
    "called_blocks",
    "find_blocks",
    "find_units",
    "module_path",
    "register_block_finder",
]

#: Separates a module's path from its call number in the unit of one call
#: (``encoder.layer#2``): a module called several times per step is one unit per
#: call. Module paths never contain it.
CALL_MARK = "#"


def call_path(path: str, call: int, calls: int) -> str:
    """The unit path of call ``call`` (0-based) of a module called ``calls`` times per step.

    A module called once keeps its own path, so plans of such models read as before.

    Example:
        >>> call_path("encoder.layer", 2, 4), call_path("head", 0, 1)
        ('encoder.layer#2', 'head')
    """
    return path if calls == 1 else f"{path}{CALL_MARK}{call}"


def module_path(unit_path: str) -> str:
    """The module path of a unit path (``encoder.layer#2`` -> ``encoder.layer``).

    Example:
        >>> module_path("encoder.layer#2")
        'encoder.layer'
    """
    return unit_path.split(CALL_MARK, 1)[0]

BlockSpec = Iterable[str] | Callable[[str, nn.Module], bool] | None
BlockFinder = Callable[[nn.Module], list[str]]


def register_block_finder(finder: BlockFinder) -> BlockFinder:
    """Teach block discovery a library's blocks: ``finder(model)`` returns their paths, or [].

    A shorthand for registering an :class:`~gradckpt.profiling.adapters.Adapter` that only
    finds blocks. The first registered finder that returns paths wins; the generic
    rules apply when none does. Registering the same finder twice is a no-op.

    Example:
        >>> register_block_finder(lambda model: [n for n, m in model.named_modules()
        ...                                      if type(m).__name__ == "MyBlock"])
    """
    name = f"blocks:{getattr(finder, '__qualname__', 'finder')}@{id(finder):x}"  # one per finder
    register_adapter(Adapter(name, find_blocks=finder))
    return finder


@dataclass(frozen=True)
class Unit:
    path: str
    module: nn.Module
    is_block: bool


def _is_torch_builtin(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn")


def _hf_layers(model: nn.Module) -> list[str]:
    found = []
    for name, module in model.named_modules():
        if name and any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__):
            found.append(name)
    return found


_LIST_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def _numbered(names: list[str]) -> bool:
    """Names like ``b1, b2, b3`` or ``layer0, layer1``: one prefix, consecutive numbers from 0 or 1."""
    matches = [_NUMBERED.match(n) for n in names]
    if not all(matches) or len({m.group(1) for m in matches if m}) != 1:
        return False
    numbers = sorted(int(m.group(2)) for m in matches if m)
    return numbers[0] in (0, 1) and numbers == list(range(numbers[0], numbers[0] + len(numbers)))


def _container_kind(module: nn.Module) -> str:
    """How ``module`` holds its children.

    "list": a ModuleList/Sequential/ModuleDict, or a plain module used as one (its
    children all of one class, named as a numbered sequence: timm's stages hold
    ``b1, b2, ...``); "single": a plain module whose only child is named like the
    first of such a sequence (a stage of one block); "": anything else (a block's
    ``expand_1x1``, ``conv_3x3``, ``reduce_1x1`` are parts, not a sequence).
    """
    if isinstance(module, _LIST_CONTAINERS):
        return "list"
    named = list(module.named_children())
    if not named or len({type(c) for _, c in named}) != 1 or not _numbered([n for n, _ in named]):
        return ""
    return "list" if len(named) >= 2 else "single"


def _container_children(model: nn.Module) -> tuple[dict[type, list[str]], dict[type, list[str]]]:
    """Non-builtin children of list-like containers and of one-child modules, by class."""
    listed: dict[type, list[str]] = defaultdict(list)
    single: dict[type, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        kind = _container_kind(module)
        if not kind:
            continue
        for child_name, child in module.named_children():
            if not _is_torch_builtin(child):
                path = f"{name}.{child_name}" if name else child_name
                (listed if kind == "list" else single)[type(child)].append(path)
    return listed, single


def _repeated_children(model: nn.Module) -> list[str]:
    listed, single = _container_children(model)
    repeated = {cls for cls, paths in listed.items() if len(paths) >= 2}
    # A stage of one block holds it as its only child: a block all the same when
    # its class repeats in the other stages.
    found = [p for cls in repeated for p in listed[cls] + single.get(cls, [])]
    modules = dict(model.named_modules())
    # A subclass of one of torch's own layers inside a block (torchtitan's feed-forward
    # holds w1, w2, w3 of its Linear subclass: numbered children of one class) is a
    # part of that block, not a block: splitting the block there would leave the
    # block's own code (the SwiGLU product, the attention, the residuals) outside
    # every unit.
    return [p for p in found if not (_part_like(modules[p]) and _inside_any(p, found))]


def _part_like(module: nn.Module) -> bool:
    """Whether ``module``'s class derives from a torch layer (not Module or a container)."""
    return any(
        c.__module__.startswith("torch.nn.") and c not in (nn.Module, *_LIST_CONTAINERS)
        for c in type(module).__mro__[1:]
    )


def _inside_any(path: str, paths: Iterable[str]) -> bool:
    return any(path.startswith(q + ".") for q in paths)


def blocks_not_found(model: nn.Module) -> str:
    """Why discovery found no blocks in ``model``: the candidates it considered, and ``blocks=``.

    Example:
        >>> print(blocks_not_found(nn.Sequential(nn.Linear(2, 2), nn.ReLU())))
    """
    listed, single = _container_children(model)
    seen = dict.fromkeys(
        f"{p} ({cls.__name__})"
        for paths in (listed, single)
        for cls, ps in paths.items()
        for p in ps
    )
    top = [f"{n} ({type(m).__name__})" for n, m in model.named_children()]
    considered = list(seen) or top
    shown = ", ".join(considered[:12]) + (
        f", ... ({len(considered)} in all)" if len(considered) > 12 else ""
    )
    return (
        f"gradckpt found no repeated blocks in {type(model).__name__}: no class repeats among "
        "the children of its containers (ModuleList, Sequential, ModuleDict, or a module whose "
        f"children all share one class); candidates considered: {shown or 'none'}. Each "
        "top-level submodule is then a single unit, which limits how low the peak can go: pass "
        "blocks=[paths from model.named_modules()] or blocks=lambda path, module: ... naming the "
        "repeated layers."
    )


def called_blocks(model: nn.Module, run: Callable[[], object]) -> list[str]:
    """Modules ``run()`` calls more than once, outermost first found: shared layers as blocks.

    What structure cannot show: ALBERT keeps one layer and calls it once per depth,
    a looped or recurrent-depth block is one module run several times. Each such
    module is a block whose every call becomes a unit of its own. Torch's own
    modules (an activation reused) and modules inside another repeated one are not.

    Example:
        >>> called_blocks(albert, lambda: albert(ids).loss)
        ['albert.encoder.albert_layer_groups.0']
    """
    counts: dict[int, int] = defaultdict(int)

    def count(module: nn.Module, args: object) -> None:
        counts[id(module)] += 1

    handles = [m.register_forward_pre_hook(count) for _, m in model.named_modules()]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    repeated = [
        name
        for name, module in model.named_modules()
        if name and counts[id(module)] > 1 and not _is_torch_builtin(module)
    ]
    return [p for p in repeated if not any(p.startswith(q + ".") for q in repeated)]


def _innermost(paths: list[str]) -> list[str]:
    # A block that contains another block is split into the finer ones: more
    # units give the planner more choices.
    chosen = set(paths)
    return [p for p in paths if not any(q != p and q.startswith(p + ".") for q in chosen)]


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[str]:
    """Qualified names of the model's blocks, in registration order.

    Args:
        model: the model.
        blocks: None to discover them; an iterable of module paths; or a
            predicate ``(path, module) -> bool``.

    Example:
        >>> find_blocks(gpt_model)
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
    """
    modules = dict(model.named_modules())
    if blocks is None:
        paths = block_candidates(model)
    elif callable(blocks):
        paths = [name for name, module in modules.items() if name and blocks(name, module)]
    else:
        paths = list(blocks)
        if isinstance(blocks, str):
            raise TypeError("blocks= takes a list of module paths, not a single string")
        missing = [p for p in paths if p not in modules or not p]
        if missing:
            raise ValueError(
                f"blocks= names modules the model does not have: {missing}; "
                "use paths from model.named_modules()"
            )
    order = {name: i for i, name in enumerate(modules)}
    return sorted(_innermost(list(dict.fromkeys(paths))), key=order.__getitem__)


def block_candidates(model: nn.Module) -> list[str]:
    """Every module discovery takes for a block, nested ones included (``find_blocks``
    keeps the innermost; :mod:`gradckpt.profiling.block_cover` settles nesting on the step).

    Example:
        >>> block_candidates(swin)[:3]
        ['layers.0', 'layers.1', 'layers.0.blocks.0']
    """
    return registered_blocks(model) or _hf_layers(model) or _repeated_children(model)


def find_units(model: nn.Module, block_paths: list[str]) -> list[Unit]:
    """Blocks plus every maximal submodule that holds no block (not the root)."""
    blocks = set(block_paths)
    ancestors = {p.rsplit(".", i)[0] for p in block_paths for i in range(1, p.count(".") + 1)}
    units: list[Unit] = []
    seen: set[int] = set()  # a module shared by two parents is one unit (its first path)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path in ancestors:
                visit(path, child)
            elif id(child) not in seen:
                seen.add(id(child))
                units.append(Unit(path, child, path in blocks))

    visit("", model)
    return units
