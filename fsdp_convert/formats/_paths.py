"""Index stage's data model, paths: a value's place in a nested state dict, flattened and rebuilt as DCP does.

Part of ``formats.index`` (which re-exports every name here): ``ObjPath`` elements are ``str``
dict keys, ``int`` list indices and ``DictKey`` int dict keys.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from fsdp_convert.formats._plain import MAX_VALUE_DEPTH, ValueShapeError, check_value

__all__ = ["ObjPath", "dcp_key", "DictKey", "plain_path", "flatten_with_paths", "unflatten", "readable_name", "readable_path"]

# a value's path in the nested state dict: str dict keys, int list indices (``DictKey``: int dict keys)
ObjPath = tuple[str | int, ...]


def dcp_key(path: ObjPath) -> str:
    """DCP's flattened key of a nested path: its elements joined by dots (``optim.param_groups.0.lr``)."""
    return ".".join(str(p) for p in path)


def readable_name(value: object) -> TypeGuard[str]:
    """Whether a DCP folder's reader takes ``value`` as a key or a data file name: a string that prints on one line.

    ``str.isprintable``: no newline, NUL, escape or other control character, no lone surrogate. The
    DCP reader (``formats._dcp_metadata``) refuses any other, and ``reshard`` refuses to write one
    (``outputs.DcpFolder.check_keys``), so what it writes its own ``inspect`` and ``verify`` read.
    """
    return isinstance(value, str) and value.isprintable()


def readable_path(path: object) -> bool:
    """Whether a DCP folder's reader takes ``path`` as a key path (``planner_data``): readable strings, 64-bit naturals."""
    return (
        isinstance(path, (tuple, list))
        and bool(path)
        and all((type(p) is int and 0 <= p < 2**63) or (type(p) is str and readable_name(p)) for p in path)
    )


class DictKey(int):
    """An ``int`` path element that keys a dict rather than indexing a list (optimizer state by id).

    DCP's paths cannot tell ``{"state": {0: ...}}`` from a list; the transform marks the ids it
    makes, and ``unflatten`` returns them as plain ``int`` keys.
    """

    __slots__ = ()


def plain_path(path: ObjPath) -> ObjPath:
    """``path`` as DCP's ``planner_data`` records it: dict keys as strings (``DictKey(0)`` -> ``"0"``).

    torch's ``unflatten_state_dict`` then rebuilds a dict, not a list, from them.
    """
    return tuple(str(int(p)) if isinstance(p, DictKey) else p for p in path)


def flatten_with_paths(obj: Mapping[Any, Any]) -> dict[str, tuple[ObjPath, Any]]:
    """Flatten a nested state dict as DCP's ``flatten_state_dict`` does: dotted key -> (path, value).

    Dicts are always walked; lists only when they hold tensors or containers that do
    (``torch/distributed/checkpoint/_traverse.py``); anything else is a value. The path is the
    value's place in the nested dict, as DCP records it in ``planner_data``; an ``int`` dict key
    becomes a ``DictKey`` (so ``unflatten`` gives back ``{0: ...}``, not ``{"0": ...}``).

    Raises:
        ValueShapeError: a value nested more than ``MAX_VALUE_DEPTH`` deep or containing itself
            (``_plain.check_value``), or shared containers that hold tensors repeated into more
            paths than 16 per object built (``x = [x, x]`` 40 times: 2^40 paths); names the top-level key.
        ValueError: a dict key that is neither a string nor an integer, or two paths with the same
            dotted key (``{"a.b": x, "a": {"b": y}}``); the message names the key.
    """
    flat: dict[str, tuple[ObjPath, Any]] = {}
    checked: dict[int, int] = {}  # every container once, whichever top-level key holds it
    size = len(obj)
    for key, value in obj.items():
        try:
            size += check_value(value, MAX_VALUE_DEPTH, checked)
        except ValueShapeError as e:
            raise ValueShapeError(f"{str(key)[:200]!r}: {e}") from None
    budget = 16 * size + 1024  # objects visited below: each once, and those a shared container repeats
    known: dict[int, bool] = {}  # id of a list -> terminal: each list is looked into once (obj keeps them alive)

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        if id(value) not in known:
            tensor = getattr(sys.modules.get("torch"), "Tensor", ())  # without torch imported, no value is a tensor
            inner = (isinstance(v, tensor) or (isinstance(v, (Mapping, list)) and not terminal(v)) for v in value)
            known[id(value)] = not any(inner)
        return known[id(value)]

    def element(path: ObjPath, key: Any) -> str | int:
        if isinstance(key, str):
            return key
        if isinstance(key, int) and not isinstance(key, bool):
            return DictKey(key)
        where = dcp_key(path) or "the top level"
        raise ValueError(f"key {key!r} under {where} is a {type(key).__name__}, not a string or integer")

    def visit(path: ObjPath, value: Any) -> None:
        nonlocal budget
        budget -= 1
        if budget < 0:
            raise ValueShapeError(f"{dcp_key(path[:1])[:200]!r}: containers that hold tensors shared into too many paths")
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, element(path, k)), v)
        elif terminal(value):
            key = dcp_key(path)
            if key in flat:
                raise ValueError(f"two entries flatten to the key {key!r} ({flat[key][0]!r} and {path!r})")
            flat[key] = (path, value)
        else:
            for i, v in enumerate(value):
                visit((*path, i), v)

    for key, value in obj.items():
        visit((element((), key),), value)
    return flat


def unflatten(items: Iterable[tuple[ObjPath, Any]]) -> dict[str, Any]:
    """Rebuild the nested state dict from (path, value) pairs, as DCP's ``unflatten_state_dict``.

    A path element that is an ``int`` indexes a list (``("optim", "param_groups", 0, "lr")``);
    a ``str`` or ``DictKey`` element keys a dict. Lists come out dense, in index order.

    Raises:
        ValueError: two paths disagree on whether a level is a list or a dict, a path is given
            twice or runs through another's value, a list index is missing, or an int does not
            fit in 64 bits (names the path).
    """
    root: dict[Any, Any] = {}
    list_nodes: set[int] = set()  # ids of dicts that stand for lists (int keys)
    for path, value in items:
        node = root
        for i, key in enumerate(path):
            is_index = isinstance(key, int) and not isinstance(key, DictKey)
            if isinstance(key, int) and not -(1 << 63) <= key < 1 << 63:  # past that, ints can share a hash
                raise ValueError(f"path {dcp_key(path[:i])[:200]!r} has a key at level {i} that does not fit in 64 bits")
            if node and is_index != (id(node) in list_nodes):
                raise ValueError(f"path {path!r} mixes list and dict keys at level {i}")
            if is_index:
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
            raise ValueError(f"list indices {_at(tuple(keys))} are not 0..{len(keys) - 1}")
        return [_densify(node[k], list_nodes) for k in keys]
    return {int(k) if isinstance(k, DictKey) else k: _densify(v, list_nodes) for k, v in node.items()}


def _at(values: tuple[int, ...]) -> str:
    """Indices for a message: the first 8 (a hostile path may claim millions)."""
    return str(list(values)) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"
