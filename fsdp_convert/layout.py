"""Layout stage: which producer wrote a checkpoint, how its entries group, and their nesting.

Pure functions over a ``CheckpointIndex``; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from fsdp_convert.metadata import CheckpointIndex, Entry, ObjPath

__all__ = ["Group", "GROUPS", "group_of", "group_of_top", "detect_producer", "unflatten"]

Group = Literal["model", "optim", "other"]
GROUPS: tuple[Group, ...] = ("model", "optim", "other")


def group_of(entry: Entry) -> Group:
    """``model`` or ``optim`` by the entry's top-level key, else ``other``."""
    return group_of_top(entry.path[0])


def group_of_top(top: str | int) -> Group:
    """The group of a top-level state dict key (``model``, ``optim``/``optimizer``, anything else)."""
    if top == "model":
        return "model"
    if top in ("optim", "optimizer"):
        return "optim"
    return "other"


def detect_producer(index: CheckpointIndex) -> str:
    """Name the training stack that wrote the checkpoint, from its key layout alone.

    Returns:
        ``"fsdp1"`` when keys carry FSDP1 wrapper names (``_fsdp_wrapped_module``, ``_flat_param``);
        ``"fsdp2"`` for the ``{"model", "optim"}`` layout of ``get_state_dict`` with
        FQN-keyed optimizer state; ``"dcp"`` for any other DCP checkpoint.
    """
    fqns = [e.fqn for e in index.entries]
    if any("_fsdp_wrapped_module" in f or "_flat_param" in f for f in fqns):
        return "fsdp1"
    tops = {e.path[0] for e in index.entries}
    optim_fqn_keyed = any(
        len(e.path) >= 4 and e.path[:2] == ("optim", "state") and isinstance(e.path[2], str) for e in index.entries
    )
    if {"model", "optim"} <= tops and optim_fqn_keyed:
        return "fsdp2"
    return "dcp"


def unflatten(items: Iterable[tuple[ObjPath, Any]]) -> dict[str, Any]:
    """Rebuild the nested state dict from (path, value) pairs, as DCP's ``unflatten_state_dict``.

    A path element that is an ``int`` indexes a list (``("optim", "param_groups", 0, "lr")``);
    a ``str`` element keys a dict. Lists come out dense, in index order.

    Raises:
        ValueError: two paths disagree on whether a level is a list or a dict, a path is given
            twice or runs through another's value, or a list index is missing (names the path).
    """
    root: dict[Any, Any] = {}
    list_nodes: set[int] = set()  # ids of dicts that stand for lists (int keys)
    for path, value in items:
        node = root
        for i, key in enumerate(path):
            if node and isinstance(key, int) != (id(node) in list_nodes):
                raise ValueError(f"path {path!r} mixes list and dict keys at level {i}")
            if isinstance(key, int):
                list_nodes.add(id(node))
            if i == len(path) - 1:
                if key in node:
                    raise ValueError(f"path {path!r} is given twice, or also holds other values")
                node[key] = _Leaf(value)
            else:
                node = node.setdefault(key, {})
                if isinstance(node, _Leaf):
                    raise ValueError(f"path {path!r} runs through a value at level {i}")
    nested: dict[str, Any] = _densify(root, list_nodes)
    return nested


class _Leaf:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _densify(node: Any, list_nodes: set[int]) -> Any:
    if isinstance(node, _Leaf):
        return node.value
    if id(node) in list_nodes:
        keys = sorted(node)
        if keys != list(range(len(keys))):
            raise ValueError(f"list indices {keys} are not 0..{len(keys) - 1}")
        return [_densify(node[k], list_nodes) for k in keys]
    return {k: _densify(v, list_nodes) for k, v in node.items()}
