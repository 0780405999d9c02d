"""Index stage's data model, plain values: bounded walks over what a pickle built (lists, dicts, tuples, sets).

Part of ``formats.index`` (which re-exports every name here). A pickle of a few KB can build a
value of 2^40 paths (``x = [x, x]`` forty times: each level refers twice to the one below), a
value that contains itself, or one nested 100,000 deep; Python's own ``==``, ``repr`` and
recursive walks then take exponential time in C (deaf to Ctrl-C), never end, or overflow the
stack. So every walk here is a loop of its own, memoized by identity: each container is visited
once, a value costs time linear in the objects the pickle built (at most its bytes), and Ctrl-C
interrupts it between two steps. ``check_value`` refuses what the rest of the tool cannot hold
(deeper than ``MAX_VALUE_DEPTH``, or containing itself); ``values_equal`` compares floats by
their bits, as tensors are compared (NaN equals a NaN of the same bits; -0.0 differs from 0.0).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_VALUE_DEPTH", "ValueShapeError", "check_value", "holds", "values_equal"]

# levels of containers in a whole state dict (a torchtitan optimizer state: 6); also what keeps
# the recursive consumers downstream (pickle's writers, reprlib) well inside Python's recursion limit
MAX_VALUE_DEPTH = 100
_SEQUENCES = (list, tuple, set, frozenset)
_pack_double = struct.Struct("<d").pack


class ValueShapeError(ValueError):
    """A value this tool does not hold: nested deeper than ``MAX_VALUE_DEPTH``, containing itself, or expanding past a bound."""


def _children(node: Any) -> Any:
    """The objects a container holds (a dict's keys and values); None for anything else (a leaf)."""
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    if isinstance(node, _SEQUENCES):
        return node
    return None


def check_value(value: Any, max_depth: int = MAX_VALUE_DEPTH, memo: dict[int, int] | None = None) -> int:
    """Check that ``value`` is a finite tree of containers at most ``max_depth`` deep; shared parts are fine.

    Depth counts containers on the longest path down (a shared list counts from its deepest
    holder, as a recursive consumer meets it). Each container is walked once.

    Args:
        value: the value.
        max_depth: the most levels of containers allowed, ``value`` itself included.
        memo: containers already checked (id -> levels), shared by calls over parts of one value
            that stays alive (ids are not reused while it is).

    Returns:
        The number of objects the containers first walked in this call hold, those containers
        included (each container counted once however often it is held: at most what the pickle built).

    Raises:
        ValueShapeError: a container holds itself (directly or further down), or the nesting is deeper
            than ``max_depth``; the message says which (never a value: the file chose them).
    """
    height = {} if memo is None else memo  # id of a finished container -> its levels, itself included
    if _children(value) is None or id(value) in height:
        if height.get(id(value), 0) > max_depth:
            raise ValueShapeError(f"a value nested more than {max_depth} deep")
        return 0
    on_path: set[int] = set()
    stack: list[tuple[Any, Any, list[int]]] = [(value, iter(_children(value)), [0])]
    on_path.add(id(value))
    size = 1
    while stack:
        node, children, below = stack[-1]
        child = next(children, stack)  # the stack itself marks the end (a value never holds it)
        size += 1
        if child is stack:
            stack.pop()
            on_path.discard(id(node))
            height[id(node)] = depth = below[0] + 1
            if depth > max_depth:
                raise ValueShapeError(f"a value nested more than {max_depth} deep")
            if stack:
                stack[-1][2][0] = max(stack[-1][2][0], depth)
            continue
        grandchildren = _children(child)
        if grandchildren is None:
            continue
        if id(child) in height:
            below[0] = max(below[0], height[id(child)])
            continue
        if id(child) in on_path:
            raise ValueShapeError(f"a value that contains itself (at level {len(stack)})")
        if len(stack) >= max_depth:
            raise ValueShapeError(f"a value nested more than {max_depth} deep")
        on_path.add(id(child))
        stack.append((child, iter(grandchildren), [0]))
    return size


def holds(value: Any, predicate: Callable[[Any], bool]) -> bool:
    """Whether ``value``, or anything its containers hold (dict values, not keys), satisfies ``predicate``.

    Each container is walked once; a container holding itself ends the walk there.
    """
    seen: set[int] = set()
    pending = [value]
    while pending:
        node = pending.pop()
        if predicate(node):
            return True
        if id(node) in seen:
            continue
        if isinstance(node, dict):
            seen.add(id(node))
            pending.extend(node.values())
        elif isinstance(node, _SEQUENCES):
            seen.add(id(node))
            pending.extend(node)
    return False


def _flat_key(value: Any) -> Any:
    """A hashable stand-in for a dict key or set element whose floats compare by their bits (NaN included)."""
    t = type(value)
    if t is float:
        return (float, _pack_double(value))
    if t is complex:
        return (complex, _pack_double(value.real), _pack_double(value.imag))
    if t is tuple:
        return (t, tuple(_flat_key(v) for v in value))
    if t is frozenset:
        return (t, frozenset(_flat_key(v) for v in value))
    return (t, value)


def values_equal(a: Any, b: Any, leaf_equal: Callable[[Any, Any], bool | None] | None = None) -> bool:
    """``a == b`` for plain values, with floats compared by their bits, in a walk of its own.

    Containers must be of the same type and hold equal items (dicts: the same keys, in any
    order). A pair of containers already being compared counts as equal where met again, so shared
    parts cost one comparison and values that contain themselves end. Other objects (a tensor)
    go to ``leaf_equal`` when given; where it gives None, or none is given, to ``==`` (an
    exception there is a difference).
    """
    seen: set[tuple[int, int]] = set()
    keep: list[Any] = []  # the pairs compared stay alive, so their ids are not reused
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        t = type(x)
        if t is not type(y):
            return False
        if t is float or t is complex or t is frozenset:
            if _flat_key(x) != _flat_key(y):
                return False
        elif isinstance(x, (dict, list, tuple, set)):
            if (id(x), id(y)) in seen:
                continue
            seen.add((id(x), id(y)))
            keep.append((x, y))
            if len(x) != len(y):
                return False
            if isinstance(x, dict):
                by_key = {_flat_key(k): v for k, v in y.items()}
                for k, v in x.items():
                    flat = _flat_key(k)
                    if flat not in by_key:
                        return False
                    pending.append((v, by_key[flat]))
            elif isinstance(x, set):
                if {_flat_key(v) for v in x} != {_flat_key(v) for v in y}:
                    return False
            else:
                pending.extend(zip(x, y))
        elif not _leaf_equal(x, y, leaf_equal):
            return False
    return True


def _leaf_equal(x: Any, y: Any, leaf_equal: Callable[[Any, Any], bool | None] | None) -> bool:
    if leaf_equal is not None and type(x) not in (str, bytes, int, bool, type(None)):
        equal = leaf_equal(x, y)
        if equal is not None:
            return equal
    try:
        return bool(x == y)
    except Exception:  # an object whose == does not give a truth value
        return False
