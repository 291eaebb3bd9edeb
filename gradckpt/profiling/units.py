"""Which modules of a model are *units*: the pieces a plan may checkpoint.

Blocks are the repeated layers (decoder layers, residual blocks). They are
found automatically — by the adapter an integration registered for its library
(:mod:`gradckpt.profiling.adapters`, or :func:`register_block_finder`), Hugging Face ``GradientCheckpointingLayer``s, or classes
that repeat among the children of ``nn.ModuleList``/``nn.Sequential``
containers — or given by the user. Every other maximal submodule that holds no
block (embeddings, final norm, head) is a unit too, so what lies between
blocks is planned as well.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from gradckpt.profiling.adapters import Adapter, register_adapter, registered_blocks

__all__ = ["Unit", "find_blocks", "find_units", "register_block_finder"]

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


def _repeated_children(model: nn.Module) -> list[str]:
    by_class: dict[type, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for child_name, child in module.named_children():
                if not _is_torch_builtin(child):
                    by_class[type(child)].append(f"{name}.{child_name}" if name else child_name)
    return [path for paths in by_class.values() if len(paths) >= 2 for path in paths]


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
        paths = registered_blocks(model) or _hf_layers(model) or _repeated_children(model)
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
