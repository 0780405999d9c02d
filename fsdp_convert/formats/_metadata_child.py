"""Index stage, DCP: a large ``.metadata`` unpickled at C speed in a forked child, its index handed back as data.

``_safe_pickle``'s interpreter decides what a ``.metadata`` may hold, at about 25 µs a chunk
record in pure Python. pickle's C unpickler takes about a third of that, but no ``find_class``
makes it safe (``_safe_pickle``'s docstring): a deeply nested tuple key crashes it, keys made to
collide make it quadratic, and BUILD, INST, SETITEM or APPEND reach objects it did not make. So
``index_in_child`` runs it in a child forked for the one file, whose harm stays there:

- ``find_class`` gives only torch's core DCP records (``_dcp_classes``, as made by
  ``FileSystemWriter``), torch dtypes and ``_dcp_records.CALLS``; each record class refuses
  arguments, ``__init__`` and a BUILD on the class itself, and gets its state through
  ``_dcp_records.record_state`` (the interpreter's check); every call is an instance whose BUILD
  is refused;
- the child builds the ``CheckpointIndex`` with the same function the interpreter's result goes
  through (``build``: every field checked), and writes its entries down a pipe with ``marshal``
  (data only: strings, ints, tuples; nothing in it is called);
- the child runs under ``RLIMIT_CPU`` and ``RLIMIT_AS`` in proportion to the file, and exits
  by ``os._exit``.

Anything else (a global outside that list, any error, a crash, a limit reached, a result that is
not a ``Metadata``) gives None: the caller then reads the file with the interpreter, which
refuses it with its message or reads what the child could not (Megatron-Core's plans, other
writers' records). Files under ``MIN_BYTES`` are left to the interpreter: forking costs more than
it saves there. POSIX only (``os.fork``); elsewhere None.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import itertools
import marshal
import mmap
import os
import pickle
import resource
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from fsdp_convert.formats import _dcp_classes as records
from fsdp_convert.formats._child_records import (
    CLEARED,
    Refused,
    admitted_call,
    emptied_alone,
    record_class,
    size_dims,
    slotted_record,
)
from fsdp_convert.formats._dcp_classes import torch_dtype
from fsdp_convert.formats._dcp_records import CALLS
from fsdp_convert.formats._safe_pickle import paused_gc
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, Entry, Location, TensorEntry, chunk_entry

__all__ = ["MIN_BYTES", "index_in_child"]

MIN_BYTES = 1 << 20  # a .metadata of about 5,000 chunk records; below, the interpreter is as fast as a fork
_CPU_SECONDS = 10  # the child's CPU limit: this, plus _CPU_PER_BYTE per byte of the file
_CPU_PER_BYTE = 1e-6  # 20x what the C unpickler and the checks take a byte
_MEMORY_PER_BYTE = 40  # the child's address space: the interpreter's, plus this many bytes per byte of the file
_MODULE = "torch.distributed.checkpoint"
_WALL_SLACK_S = 10  # the child's wall deadline: twice its CPU limit, plus this (a child waiting, not computing)
_OK = 0  # the child's exit status when it wrote an index
_BATCH = 64  # entries a frame: the parent makes the entries of one while the child writes the next


# torch's core records as FileSystemWriter pickles them; any other class is the interpreter's to read
_RECORDS = {
    (f"{_MODULE}.metadata", name): record_class(getattr(records, name))
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "StorageMeta")
}
_RECORDS |= {
    (f"{_MODULE}.metadata", name): slotted_record(getattr(records, name)) for name in ("ChunkStorageMetadata", "MetadataIndex")
}
_RECORDS[(f"{_MODULE}.filesystem", "_StorageInfo")] = slotted_record(records.StorageInfo)
_CALLS = {key: admitted_call(function, takes_dicts=key == ("collections", "OrderedDict")) for key, function in CALLS.items()}
_CALLS[("torch", "Size")] = admitted_call(size_dims)
_DROP_BYTES = 4 << 20  # the mapping's pages read are dropped from the child's memory this many bytes at a time


class _MappedStream:
    """A read-only mapping read front to back by the unpickler, its pages dropped from this process once read.

    The file's pages stay in the page cache; the child's memory holds the records, not the file too
    (``.metadata`` is a tenth of the records it makes). ``peek`` lets the C unpickler take 512 KiB
    a call, as from a buffered file.
    """

    def __init__(self, mapping: mmap.mmap) -> None:
        self._mapping, self._at, self._dropped = mapping, 0, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._mapping) if n < 0 else min(len(self._mapping), self._at + n)
        data = self._mapping[self._at : end]
        self._at = end
        if end - self._dropped >= _DROP_BYTES:
            upto = end - end % mmap.PAGESIZE
            self._mapping.madvise(mmap.MADV_DONTNEED, self._dropped, upto - self._dropped)
            self._dropped = upto
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self) -> bytes:
        newline = self._mapping.find(b"\n", self._at)
        return self.read(len(self._mapping) - self._at if newline < 0 else newline + 1 - self._at)

    def peek(self, n: int = 0) -> bytes:
        return self._mapping[self._at : self._at + max(n, 1)]

    def tell(self) -> int:
        return self._at


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found: Any = _RECORDS.get((module, name)) or _CALLS.get((module, name))
        if found is None and module == "torch":
            found = torch_dtype(name)  # a str subclass without __dict__: BUILD on it fails
        if found is None:
            raise Refused("a global the child does not admit")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("a persistent id")


def _entry_data(entry: Entry) -> tuple[Any, ...]:
    """One entry as marshal's data: ``(0, fqn, path, shape, dtype, chunks)`` or ``(1, fqn, path, file, offset, length, ...)``."""
    if isinstance(entry, TensorEntry):
        chunks = tuple(
            (c.offsets, c.sizes, c.relative_path, c.offset_bytes, c.length_bytes, c.transform_descriptors, c.record)
            for c in entry.chunks
        )
        return (0, entry.fqn, entry.path, entry.shape, entry.dtype_name, chunks)
    return (
        1, entry.fqn, entry.path, entry.relative_path, entry.offset_bytes, entry.length_bytes,
        entry.transform_descriptors, entry.record,
    )  # fmt: skip


def _entry(data: tuple[Any, ...]) -> Entry:
    """``_entry_data`` read back."""
    if data[0] == 0:
        _, fqn, path, shape, dtype_name, chunks = data
        boxes = tuple(itertools.starmap(chunk_entry, chunks))  # fields in ChunkEntry's order
        return TensorEntry(fqn=fqn, path=path, shape=shape, dtype_name=dtype_name, chunks=boxes)
    _, fqn, path, rel, offset, length, transforms, record = data
    return BytesEntry(
        fqn=fqn, path=path, relative_path=rel, offset_bytes=offset, length_bytes=length,
        transform_descriptors=transforms, record=record,
    )  # fmt: skip


def _cpu_seconds(size: int) -> int:
    """The child's CPU limit for a file of ``size`` bytes, in seconds."""
    return int(_CPU_SECONDS + _CPU_PER_BYTE * size)


def _address_space() -> int:
    """The address space this process holds now, in bytes (what a CUDA build of torch reserves too), at least 4x its RSS."""
    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 * 4
    try:
        with open("/proc/self/statm") as f:
            return max(floor, int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return floor


def _child(data: Any, build: Callable[[Any], CheckpointIndex], out: int) -> int:
    """The child's work: load, build, write; its exit status."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)  # the parent's handlers clean up the parent's files, not the child's
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash writes no core file
    faulthandler.disable()  # nor a traceback on the parent's stderr: a crash here is an answer, not a fault
    gc.disable()  # millions of objects and no cycles; the process ends after
    size = len(data)
    cpu = _cpu_seconds(size)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    address = _address_space() + (1 << 30) + _MEMORY_PER_BYTE * size
    resource.setrlimit(resource.RLIMIT_AS, (address, address))
    stream = _MappedStream(data) if isinstance(data, mmap.mmap) else io.BytesIO(data)  # a mapping is read in place
    unpickler = _Unpickler(stream)
    metadata = unpickler.load()
    if stream.tell() != size or not isinstance(metadata, records.Metadata) or not emptied_alone():
        return 1  # data after the pickle, not a Metadata, or an emptied state used: the interpreter names it
    del unpickler  # its memo
    CLEARED.clear()
    index = build(metadata)
    del metadata, stream  # the records: the entries hold what the parent is sent
    entries = list(index.entries)
    _send(out, (index.data_files, index.version, index.save_id))
    del index
    while entries:  # the parent makes the entries of one frame while this dumps the next, and frees it
        batch = entries[:_BATCH]
        del entries[:_BATCH]
        _send(out, tuple(map(_entry_data, batch)))
    return _OK


def _send(fd: int, value: Any) -> None:
    """Write ``value`` down the pipe ``fd`` as one frame: its ``marshal`` length (8 bytes, little-endian) and data."""
    payload = marshal.dumps(value)
    view = memoryview(len(payload).to_bytes(8, "little") + payload)
    while view:
        view = view[os.write(fd, view) :]


class _Late(Exception):
    """The child's deadline passed before the end of its pipe."""


def _frames(fd: int, deadline: float) -> Iterator[Any]:
    """The values of each whole frame ``_send`` wrote down the pipe ``fd``, as they come, to its end.

    Raises:
        _Late: at ``deadline`` (``time.monotonic``).
        ValueError: the pipe ended inside a frame (the child died writing it).
    """
    buffer = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            continue
        block = os.read(fd, 1 << 20)
        if not block:
            if buffer:
                raise ValueError("the pipe ended inside a frame")
            return
        buffer += block
        while len(buffer) >= 8 and len(buffer) >= 8 + (n := int.from_bytes(buffer[:8], "little")):
            yield marshal.loads(bytes(buffer[8 : 8 + n]))
            del buffer[: 8 + n]
    raise _Late


def _read_frames(pid: int, fd: int, deadline: float) -> list[Any] | None:
    """The child ``pid``'s header and entry batches from the pipe ``fd`` (closed here); None: it failed or is late (killed)."""
    read: list[Any] = []
    try:
        for frame in _frames(fd, deadline):
            read.append(frame if not read else list(map(_entry, frame)))
    except _Late:  # stuck without using CPU (a lock a thread of the parent held at the fork)
        os.kill(pid, signal.SIGKILL)
        return None
    except (ValueError, EOFError, TypeError):  # a frame cut short, or one that is no entries: the child failed
        return None
    finally:
        os.close(fd)
    return read


def index_in_child(data: Any, checkpoint_id: Location, build: Callable[[Any], CheckpointIndex]) -> CheckpointIndex | None:
    """The index of a ``.metadata``'s bytes, unpickled by the C unpickler in a forked child; None: read it the other way.

    Args:
        data: the file's bytes (``bytes`` or a read-only ``mmap``), at least ``MIN_BYTES``.
        checkpoint_id: the index's ``checkpoint_id`` (``build`` gives the same).
        build: makes the index of the loaded ``Metadata`` record, checking every field (``formats.dcp``'s
            ``build_index`` with its data-file reads); run in the child.

    Returns:
        The index ``build`` made, its entries as they were (data files, version and save id too);
        None where the child did not make one (see the module docstring) or cannot fork.
    """
    if len(data) < MIN_BYTES or not hasattr(os, "fork"):
        return None
    read_end, write_end = os.pipe()
    sys.stdout.flush(), sys.stderr.flush()  # nothing buffered is written twice
    with warnings.catch_warnings():  # Python 3.12 warns of fork() beside threads; a child stuck on a lock meets the deadline
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover  (the child; coverage does not follow it)
        status = 1
        try:
            os.close(read_end)
            status = _child(data, build, write_end)
        except BaseException:  # noqa: BLE001  (any failure is the interpreter's to name)
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    with paused_gc():  # millions of entries made, no cycles: a collection would walk them all
        read = _read_frames(pid, read_end, time.monotonic() + 2 * _cpu_seconds(len(data)) + _WALL_SLACK_S)
    _, wait_status = os.waitpid(pid, 0)
    if not read or not os.WIFEXITED(wait_status) or os.WEXITSTATUS(wait_status) != _OK:
        return None
    (data_files, version, save_id), *batches = read
    return CheckpointIndex(
        checkpoint_id=checkpoint_id,
        entries=tuple(itertools.chain.from_iterable(batches)),
        data_files=data_files,
        version=version,
        save_id=save_id,
    )
