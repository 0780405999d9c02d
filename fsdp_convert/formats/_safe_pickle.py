"""Index stage, shared: a pickle interpreter for data only, whose hooks decide every global, call and BUILD.

``pickle.Unpickler`` with a ``find_class`` allow-list is not enough for a file from anywhere:

- BUILD runs on whatever is on the stack, an allow-listed *class* included, and its
  ``setattr`` changes that class for the whole process (``pathlib.Path.__hash__ = None``);
- APPEND, SETITEM and ADDITEMS call methods of any object on the stack;
- EXT1/2/4 resolve names through the process-wide ``copyreg`` extension registry, INST and OBJ
  call classes, PERSID and BINPERSID call ``persistent_load``;
- a dict key or set element is hashed in C, and hashing a tuple nested a million deep overflows
  the C stack: the process dies of SIGSEGV (CPython 3.10 to 3.13 have no recursion check there);
- unsalted hashes (ints, tuples) can be made to collide: over ``MAX_SAME_HASH`` alike are refused.

So this reads the opcodes itself (about 2x the C unpickler's time; see ``SafeUnpickler.load``):
protocols 2 to 5, the data opcodes only; no opcode changes an object it did not create in this
load, every call goes through ``call``, ``new`` or ``build``, which a subclass defines, and a
dict key or set element must be a flat value (``key_ok`` may admit more).
"""

from __future__ import annotations

import contextlib
import gc
import pickle
import pickletools
import reprlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any

__all__ = ["RefusedError", "MalformedError", "SafeUnpickler", "paused_gc", "shown", "described"]

_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
# opcodes that call or look up code (classes, the copyreg registry, persistent_load): refused as
# unsafe. Others not handled (protocol 0 and 1 text, out-of-band buffers) are malformed input.
_CODE_OPCODES = frozenset({"INST", "OBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID"})
_FLAT_KEYS = frozenset({str, int, float, bool, bytes, type(None)})
MAX_SAME_HASH = 64  # keys of one container sharing one unsalted hash (real checkpoints: 1)
_unpack_from = struct.unpack_from
_shortrepr = reprlib.Repr()
_shortrepr.maxstring = _shortrepr.maxother = 80
_shortrepr.maxlong = 40


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside: loading and indexing make millions of objects and no cycles.

    With a large object graph alive, each collection walks all of it: with it on, indexing a
    200,000-chunk ``.metadata`` took twice as long.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class RefusedError(pickle.UnpicklingError):
    """The pickle asks for something outside the allow-list (it could run or change code)."""


class MalformedError(pickle.UnpicklingError):
    """The bytes are not a well-formed pickle of data (truncated, unknown opcode, stack misuse)."""


def shown(value: Any) -> str:
    """A value read from a file as one printable line of at most 80 characters (never raises, unlike ``repr``)."""
    try:
        text = value if isinstance(value, str) and value.isprintable() else _shortrepr.repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def described(obj: Any) -> str:
    """What an object on the stack is, for a refusal: ``class Metadata``, ``function torch_size``, ``str 'x'``."""
    if isinstance(obj, type):
        return f"class {obj.__qualname__}"
    if callable(obj) and isinstance(getattr(obj, "__qualname__", None), str):
        return f"function {obj.__qualname__}"
    # the value itself only for plain ones: the repr of a storage or record could be gigabytes
    return f"{type(obj).__name__} {shown(obj)}" if type(obj) in _FLAT_KEYS else f"a {type(obj).__name__}"


class SafeUnpickler:
    """Loads one pickle of plain data from ``data``; subclasses admit globals and calls.

    Admitted always: None, bools, ints, floats, str, bytes, bytearrays, tuples, lists, dicts and
    sets built from them, and memo references. Everything else goes through the hooks below, which
    refuse by default.
    """

    def __init__(self, data: bytes | memoryview | Any) -> None:
        self._data = data
        self.end = 0  # after load(): the offset just past STOP, in bytes
        self._hashes: dict[int, Counter[int]] = {}  # id of a container -> keys per unsalted hash

    def find_class(self, module: str, name: str) -> Any:  # the hooks, then the interpreter
        """What GLOBAL / STACK_GLOBAL ``module.name`` pushes; refuses by default."""
        raise RefusedError(f"refusing global {shown(module)}.{shown(name)}")

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        """REDUCE: ``func(*args)`` for a ``func`` this loader admitted; refuses by default."""
        raise RefusedError(f"refusing to call {described(func)}")

    def new(self, cls: Any, args: tuple[Any, ...]) -> Any:
        """NEWOBJ: a fresh instance of an admitted record class; refuses by default."""
        raise RefusedError(f"refusing to create an instance of {described(cls)}")

    def build(self, obj: Any, state: Any) -> None:
        """BUILD: set the state of an object this load created; refuses by default.

        An ``OrderedDict`` (only ``_torch_globals.VETTED_CALLS`` makes one, fresh) may get a dict of attributes,
        as ``state_dict()``'s ``_metadata``: it is dropped.
        """
        if type(obj) is OrderedDict and type(state) is dict and all(type(k) is str for k in state):
            return
        raise RefusedError(f"refusing to set the state of {described(obj)}")

    def persistent_load(self, pid: Any) -> Any:
        """BINPERSID: the object a persistent id names; refuses by default."""
        raise RefusedError("refusing a persistent id")

    def key_ok(self, key: Any) -> bool:
        """Whether ``key`` may be hashed (a dict key or set element) beyond the flat values."""
        return False

    # --- the interpreter ------------------------------------------------------------------------

    def _key(self, key: Any) -> Any:
        t = type(key)
        if t in _FLAT_KEYS or (t is tuple and all(type(k) in _FLAT_KEYS for k in key)) or self.key_ok(key):
            return key
        raise MalformedError(f"a dict key or set element is a {t.__name__}")

    def _unflooded(self, target: object, keys: list[Any]) -> list[Any]:
        """``keys`` (checked by ``_key``) for ``target``; more than ``MAX_SAME_HASH`` sharing an unsalted hash is refused."""
        if not _FLAT_KEYS.issuperset(map(type, keys)):  # hashes types only, never a key
            keys = [self._key(k) for k in keys]
        counts = self._hashes.setdefault(id(target), Counter())
        for h in [hash(k) for k in keys if type(k) is not str and type(k) is not bytes]:
            counts[h] += 1
            if counts[h] > MAX_SAME_HASH:
                raise MalformedError(f"over {MAX_SAME_HASH} dict keys or set elements made to share one hash")
        return keys

    def _setitems(self, target: Any, items: list[Any]) -> None:
        if type(target) is not dict and type(target) is not OrderedDict:
            raise RefusedError(f"refusing to set items of {described(target)}")
        if len(items) % 2:
            raise MalformedError("SETITEMS with an odd number of items")
        target.update(zip(self._unflooded(target, items[0::2]), items[1::2]))

    def load(self) -> Any:
        """Interpret the pickle at the start of ``data``; ``self.end`` is where it stopped.

        Raises:
            RefusedError: an opcode or hook refused (it could run or change code).
            MalformedError: anything else wrong, with the byte offset.
        """
        try:
            with paused_gc():  # the load makes millions of containers and no garbage
                return _interpret(self, self._data)
        except pickle.UnpicklingError:
            raise
        except MemoryError as e:
            raise MalformedError(f"does not fit in memory (at byte {self.end})") from e
        except Exception as e:  # stack or memo misuse, bad arguments to an admitted call, bad UTF-8
            raise MalformedError(f"{type(e).__name__} at byte {self.end}") from e


def _interpret(unpickler: SafeUnpickler, data: Any) -> Any:
    """``SafeUnpickler.load``'s loop, over ``data`` (bytes or an mmap); ``unpickler`` supplies the hooks."""
    # One flat loop, the commonest opcodes of a DCP .metadata first: a method call per opcode
    # would double the time. unpickler.end is set only when leaving, for messages.
    n = len(data)
    pos = 0
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    memo: list[Any] = []  # picklers number memo entries 0, 1, 2...; a list needs no int objects
    memoize = memo.append
    push = stack.append
    new, build, call, setitems = unpickler.new, unpickler.build, unpickler.call, unpickler._setitems
    op_at = 0
    try:
        while True:
            op_at = pos
            if pos >= n:
                raise MalformedError("truncated: no STOP")
            op = data[pos]
            pos += 1
            if op == 0x94:  # MEMOIZE
                memoize(stack[-1])
            elif op == 0x68:  # BINGET
                push(memo[data[pos]])
                pos += 1
            elif op == 0x6A:  # LONG_BINGET
                push(memo[_unpack_from("<I", data, pos)[0]])
                pos += 4
            elif op == 0x28:  # MARK
                metastack.append(stack)
                stack = []
                push = stack.append
            elif op == 0x4B:  # BININT1
                push(data[pos])
                pos += 1
            elif op == 0x29:  # EMPTY_TUPLE
                push(())
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                if type(args) is not tuple:
                    raise MalformedError("NEWOBJ arguments are not a tuple")
                stack[-1] = new(stack[-1], args)
            elif op == 0x62:  # BUILD
                state = stack.pop()
                build(stack[-1], state)
            elif op == 0x8C:  # SHORT_BINUNICODE
                length = data[pos]
                pos += 1
                push(str(data[pos : pos + length], "utf-8", "surrogatepass"))
                pos += length
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = metastack.pop()
                push = stack.append
                setitems(stack[-1], items)
            elif op == 0x7D:  # EMPTY_DICT
                push({})
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                if type(args) is not tuple:
                    raise MalformedError("REDUCE arguments are not a tuple")
                stack[-1] = call(stack[-1], args)
            elif op == 0x86:  # TUPLE2
                second = stack.pop()
                stack[-1] = (stack[-1], second)
            elif op == 0x5D:  # EMPTY_LIST
                push([])
            elif op == 0x89:  # NEWFALSE
                push(False)
            elif op == 0x88:  # NEWTRUE
                push(True)
            elif op == 0x74:  # TUPLE
                items = stack
                stack = metastack.pop()
                push = stack.append
                push(tuple(items))
            elif op == 0x4D:  # BININT2
                push(data[pos] | data[pos + 1] << 8)
                pos += 2
            elif op == 0x4A:  # BININT
                push(_unpack_from("<i", data, pos)[0])
                pos += 4
            elif op == 0x4E:  # NONE
                push(None)
            elif op == 0x71:  # BINPUT
                _put(memo, data[pos], stack[-1])
                pos += 1
            elif op == 0x72:  # LONG_BINPUT
                _put(memo, _unpack_from("<I", data, pos)[0], stack[-1])
                pos += 4
            elif op == 0x58:  # BINUNICODE
                length = _unpack_from("<I", data, pos)[0]
                pos += 4
                push(_text(data, pos, length))
                pos += length
            elif op == 0x8D:  # BINUNICODE8
                length = _unpack_from("<Q", data, pos)[0]
                pos += 8
                push(_text(data, pos, length))
                pos += length
            elif op == 0x61:  # APPEND
                value = stack.pop()
                _list(stack[-1]).append(value)
            elif op == 0x65:  # APPENDS
                items = stack
                stack = metastack.pop()
                push = stack.append
                _list(stack[-1]).extend(items)
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                setitems(stack[-1], [key, value])
            elif op == 0x87:  # TUPLE3
                third = stack.pop()
                second = stack.pop()
                stack[-1] = (stack[-1], second, third)
            elif op == 0x8A or op == 0x8B:  # LONG1, LONG4
                length = data[pos] if op == 0x8A else _unpack_from("<i", data, pos)[0]
                pos += 1 if op == 0x8A else 4
                if length < 0 or pos + length > n:
                    raise MalformedError(f"a long integer does not fit in the pickle (at byte {pos})")
                push(int.from_bytes(data[pos : pos + length], "little", signed=True))
                pos += length
            elif op == 0x47:  # BINFLOAT
                push(_unpack_from(">d", data, pos)[0])
                pos += 8
            elif op == 0x43 or op == 0x42 or op == 0x8E or op == 0x96:  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                width = {0x43: 1, 0x42: 4, 0x8E: 8, 0x96: 8}[op]
                length = int.from_bytes(data[pos : pos + width], "little")
                pos += width
                push(_bytes(data, pos, length, bytearray if op == 0x96 else bytes))
                pos += length
            elif op == 0x64:  # DICT
                items = stack
                stack = metastack.pop()
                push = stack.append
                push({})
                setitems(stack[-1], items)
            elif op == 0x6C:  # LIST
                items = stack
                stack = metastack.pop()
                push = stack.append
                push(items)
            elif op == 0x8F:  # EMPTY_SET
                push(set())
            elif op == 0x90:  # ADDITEMS
                items = stack
                stack = metastack.pop()
                push = stack.append
                if type(stack[-1]) is not set:
                    raise RefusedError(f"refusing to add items to {described(stack[-1])}")
                stack[-1].update(unpickler._unflooded(stack[-1], items))
            elif op == 0x91:  # FROZENSET
                items = stack
                stack = metastack.pop()
                push = stack.append
                push(frozenset(unpickler._unflooded(items, items)))
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                module = stack.pop()
                if type(module) is not str or type(name) is not str:
                    raise MalformedError("STACK_GLOBAL names are not strings")
                push(unpickler.find_class(module, name))
            elif op == 0x63:  # GLOBAL: two text lines
                module, pos = _line(data, pos)
                name, pos = _line(data, pos)
                push(unpickler.find_class(module, name))
            elif op == 0x51:  # BINPERSID
                stack[-1] = unpickler.persistent_load(stack[-1])
            elif op == 0x95:  # FRAME: the data is all here; only check the frame fits
                length = _unpack_from("<Q", data, pos)[0]
                pos += 8
                if pos + length > n:
                    raise MalformedError(f"a frame does not fit in the pickle (at byte {pos - 9})")
            elif op == 0x80:  # PROTO
                if not 2 <= data[pos] <= 5:
                    raise MalformedError("unsupported pickle protocol")
                pos += 1
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    stack = metastack.pop()
                    push = stack.append
            elif op == 0x31:  # POP_MARK
                stack = metastack.pop()
                push = stack.append
            elif op == 0x32:  # DUP
                push(stack[-1])
            elif op == 0x2E:  # STOP
                unpickler.end = pos
                if len(stack) != 1 or metastack:
                    raise MalformedError("STOP with a stack that does not hold exactly one object")
                return stack[0]
            else:
                name = _OPCODE_NAMES.get(op)
                if name in _CODE_OPCODES:
                    raise RefusedError(f"refusing opcode {name} at byte {pos - 1}")
                what = f"unsupported opcode {name}" if name else "unknown opcode"
                raise MalformedError(f"{what} at byte {pos - 1}")
    except BaseException:
        unpickler.end = op_at  # where the failing opcode starts, for the message
        raise


def _put(memo: list[Any], index: int, value: Any) -> None:
    if index == len(memo):
        memo.append(value)
    elif index < len(memo):
        memo[index] = value
    else:
        raise MalformedError("a memo entry out of order")


def _list(target: Any) -> list[Any]:
    if type(target) is not list:
        raise RefusedError(f"refusing to append to {described(target)}")
    return target


def _text(data: Any, pos: int, length: int) -> str:
    if pos + length > len(data):
        raise MalformedError(f"a string does not fit in the pickle (at byte {pos})")
    return str(data[pos : pos + length], "utf-8", "surrogatepass")


def _bytes(data: Any, pos: int, length: int, kind: type[bytes] | type[bytearray]) -> bytes | bytearray:
    if pos + length > len(data):
        raise MalformedError(f"a bytes value does not fit in the pickle (at byte {pos})")
    return kind(data[pos : pos + length])


def _line(data: Any, pos: int) -> tuple[str, int]:
    end = data.find(b"\n", pos)
    if end < 0:
        raise MalformedError(f"a GLOBAL name has no end (at byte {pos})")
    return str(data[pos:end], "utf-8"), end + 1
