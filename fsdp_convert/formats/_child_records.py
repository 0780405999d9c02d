"""Index stage, DCP: the records and calls the ``.metadata`` child's C unpickler may make (``_metadata_child``).

Each is built so that no opcode can change it or reach anything else: a record class refuses
arguments, calls and a BUILD on anything but a fresh record of its own; an admitted call is an
instance whose BUILD is refused. The three records there is one of per chunk are slotted
(``slotted_record``): a third of the memory of a ``__dict__`` each, at the cost of emptying
their state dicts, which ``emptied_alone`` then checks nothing else holds. Any refusal raises
``Refused``: the child gives up and the interpreter (``_safe_pickle``) reads the file.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Callable
from typing import Any

from fsdp_convert.formats._dcp_records import record_state

__all__ = ["Refused", "record_class", "slotted_record", "CLEARED", "emptied_alone", "admitted_call", "size_dims"]


class Refused(Exception):
    """Raised by the child's stand-ins: the parent falls back to the interpreter."""


def record_class(base: type) -> type:
    """A subclass of the ``_dcp_classes`` record ``base`` that only NEWOBJ + BUILD can make, as pickle does."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        if args or kwargs:
            raise Refused("a record made with arguments")
        return object.__new__(cls)

    def __setstate__(self: Any, state: Any) -> None:  # noqa: N807
        if type(self) is not made or getattr(self, "__dict__", None):  # BUILD on the class, or twice
            raise Refused("BUILD on something that is no fresh record")
        if type(state) is dict and not state:  # perhaps a state a slotted record emptied (slotted_record)
            raise Refused("an empty state")
        object.__setattr__(self, "__dict__", record_state(base, state))

    made = type(base.__name__, (base,), {"__new__": __new__, "__init__": _called, "__setstate__": __setstate__})
    return made


def _called(self: Any, *args: Any, **kwargs: Any) -> None:
    """A record class's ``__init__``: pickle makes records by NEWOBJ + BUILD, so a call (REDUCE, INST, OBJ) is refused."""
    raise Refused("a record class called")


# The state dicts slotted records emptied: each must be referenced by the unpickler's memo alone
# when the load ends (and by this list), or the file is the interpreter's to read.
CLEARED: list[dict[str, Any]] = []
_MISSING = object()


def slotted_record(base: type) -> type:
    """A slotted subclass of a record there is one of per chunk (``base``): a third of the memory.

    BUILD moves the state's fields into slots and empties the state dict, which the unpickler's
    memo holds to the end of the load. A state of any other field (a newer torch's) is refused
    and the file left to the interpreter, as is a state dict used anywhere else: an empty state
    is refused by every record and call, and a reference to an emptied one found after the load
    (``emptied_alone``).
    """
    fields = dataclasses.fields(base)
    names = frozenset(f.name for f in fields)
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        if args or kwargs:
            raise Refused("a record made with arguments")
        record: Any = object.__new__(cls)
        fresh(record, True)
        return record

    def __setstate__(self: Any, state: Any) -> None:  # noqa: N807
        if type(self) is made and self._fresh and type(state) is dict:  # type: ignore[attr-defined]
            try:  # every field, or those without a default, as torch writes them (millions): taken at C speed
                values = None
                if len(state) == len(order):
                    values = every_field(state)
                elif required_fields is not None and len(state) == len(required):
                    values = required_fields(state) + rest
            except KeyError:
                values = None
            if values is not None:
                fresh(self, False)
                fill(self, values)
                CLEARED.append(state)
                state.clear()
                return
        if type(self) is not made or not self._fresh or type(state) is not dict or not state or not names.issuperset(state):  # type: ignore[attr-defined]
            raise Refused("BUILD on something that is no fresh record, or with other fields")
        fresh(self, False)
        for put, name in zip(puts, order, strict=True):
            value = state.get(name, _MISSING)
            if value is _MISSING:
                if name not in defaults:
                    raise Refused("a record without one of its fields")
                value = defaults[name]
            put(self, value)
        CLEARED.append(state)
        state.clear()

    slots = (*(f.name for f in fields), "_fresh")
    made = type(
        base.__name__, (base,), {"__slots__": slots, "__new__": __new__, "__init__": _called, "__setstate__": __setstate__}
    )
    fresh = made._fresh.__set__  # type: ignore[attr-defined]
    order = [f.name for f in fields]
    puts = [getattr(made, name).__set__ for name in order]
    every_field = operator.itemgetter(*order)  # (two fields or more: a tuple)
    required = [name for name in order if name not in defaults]  # first: a dataclass orders them so
    required_fields = operator.itemgetter(*required) if len(required) > 1 else None
    rest = tuple(defaults[name] for name in order[len(required) :])
    fill = _filler(puts)
    return made


def _filler(puts: list[Callable[[Any, Any], None]]) -> Callable[[Any, tuple[Any, ...]], object]:
    """``fill(record, values)``: each of ``puts`` (slot setters) called with its value, unrolled for 2 to 4 fields.

    A loop over ``zip`` took a third of a BUILD's time, at millions of BUILDs.
    """
    if len(puts) == 2:
        a, b = puts
        return lambda r, v: (a(r, v[0]), b(r, v[1]))
    if len(puts) == 3:
        a, b, c = puts
        return lambda r, v: (a(r, v[0]), b(r, v[1]), c(r, v[2]))
    if len(puts) == 4:
        a, b, c, d = puts
        return lambda r, v: (a(r, v[0]), b(r, v[1]), c(r, v[2]), d(r, v[3]))

    def fill(record: Any, values: tuple[Any, ...]) -> None:
        for put, value in zip(puts, values, strict=True):
            put(record, value)

    return fill


def emptied_alone() -> bool:
    """Whether no state dict a slotted record emptied is held by anything but the memo (and ``CLEARED``)."""
    return max(map(sys.getrefcount, CLEARED), default=0) <= 3  # the memo, the list, the call's argument


def size_dims(dims: Any) -> tuple[Any, ...]:
    """``torch.Size(dims)`` in the child: the tuple of its dims, ``dims`` itself (the memo holds it anyway; millions).

    Its ints are checked where every size, offset and shape is read: ``build_index``, as plain
    tuples of 64-bit naturals (a ``torch.Size`` anywhere else is not in the index).
    """
    if type(dims) is tuple:
        return dims
    if type(dims) is list:
        return tuple(dims)
    raise Refused("a torch.Size of something other than a sequence")


def admitted_call(function: Callable[..., Any], *, takes_dicts: bool = False) -> Any:
    """An admitted function (``_dcp_records.CALLS``) as REDUCE calls it; BUILD, SETITEM, APPEND on it fail.

    An instance of a class of its own whose ``__call__`` is the function: no frame between. One
    that ``takes_dicts`` (``OrderedDict``: it copies one) refuses an empty dict, perhaps a state
    a slotted record emptied; the others refuse any dict themselves.
    """

    def __setstate__(self: Any, state: Any) -> None:  # noqa: N807
        raise Refused("BUILD on an admitted function")

    def checked(*args: Any) -> Any:
        for arg in args:
            if type(arg) is dict and not arg:
                raise Refused("an empty dict passed to a call")
        return function(*args)

    call = checked if takes_dicts else function
    return type("_Call", (), {"__slots__": (), "__call__": staticmethod(call), "__setstate__": __setstate__})()
