"""torch.save writer that streams: storage records first, as tensors arrive; the pickle last.

torch.save's container (``torch/serialization.py``, ``_save``) is a zip of one record per storage
(``data/<key>``), a pickle ``data.pkl`` that refers to storages only by key through
``persistent_id``, and small records ``.format_version``, ``.storage_alignment``, ``byteorder``;
``version`` and ``.data/serialization_id`` are added by the zip writer. Record order does not
matter to ``torch.load``, so each tensor's storage is written the moment it arrives and freed,
and ``data.pkl`` is written at the end. The zip itself is written by torch's own
``torch._C.PyTorchFileWriter`` (64-byte aligned records), so the result is an ordinary torch.save
file that ``torch.load(path, weights_only=True, mmap=True)`` reads. Its CRC-32s are computed with
zlib (several GB/s, against 0.35 GB/s for torch's writer here) and patched in at the end
(``_zipcrc.py``), so ``zipfile.testzip`` and ``unzip -t`` pass.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
import zlib
from pathlib import Path
from typing import IO, Any

import torch

from fsdp_convert._signals import torch_call
from fsdp_convert._torch import open_torch_save_writer, storage_alignment, storage_type_for
from fsdp_convert.formats.index import ObjPath, unflatten
from fsdp_convert.writers._buffer import byte_view, close_synced, dense
from fsdp_convert.writers._zipcrc import patch_crcs

__all__ = ["TorchSaveWriter", "PICKLE_PROTOCOL"]

PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


class _StorageRef:
    """Stands for a storage already written as record ``data/<key>``."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class _TensorRef:
    """Pickles exactly as torch.save pickles a contiguous CPU tensor over a written storage."""

    __slots__ = ("storage", "shape")

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        args: tuple[Any, ...] = (
            self.storage,
            0,
            torch.Size(self.shape),
            _contiguous_stride(self.shape),
            False,
            collections.OrderedDict(),
        )
        if storage_type_for(self.storage.dtype) is None:
            # dtypes without a legacy storage class: untyped storage, dtype passed explicitly
            return (torch._utils._rebuild_tensor_v3, (*args, self.storage.dtype))
        return (torch._utils._rebuild_tensor_v2, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = storage_type_for(obj.dtype)
            if storage_type is None:
                return ("storage", torch.storage.UntypedStorage, obj.key, "cpu", obj.numel * obj.dtype.itemsize)
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class _AbortableStream:
    """File wrapper that never lets an exception reach torch's zip writer.

    If a write fails (disk full, file too large) inside ``torch._C.PyTorchFileWriter``, or a
    signal handler raises (Ctrl-C, SIGTERM) in this Python callback, the exception would cross
    torch's C++ writer: its bookkeeping goes out of step and the process aborts. So the exception
    is recorded, the write reported as done, and every later write discarded; the torch.save
    writer re-raises it after the call returns, and the caller deletes the file.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        n = len(memoryview(data))
        if self.error is None:
            try:
                self.file.write(data)
            except BaseException as e:  # also Ctrl-C or SIGTERM landing in this callback
                self.error = e
        return n

    def flush(self) -> None:
        if self.error is None:
            try:
                self.file.flush()
            except BaseException as e:
                self.error = e

    def abort(self) -> None:
        """Discard every later write."""
        if self.error is None:
            self.error = OSError("writer closed")

    def raise_error(self) -> None:
        """Re-raise the first write error, if any."""
        if self.error is not None:
            raise self.error


class TorchSaveWriter:
    """Streams a nested state dict into one torch.save file. Rank 0 only.

    ``add_tensor`` writes the tensor's bytes at once (the caller can free the tensor);
    ``finish`` writes the pickle of the nested structure, closes the zip and fsyncs.
    Memory held: the nested structure of small references and plain values, not the tensors.

    Args:
        path: the file to create (normally a temporary sibling of the output).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[bytes] = open(self.path, "x+b")  # noqa: SIM115 (closed in finish/close)
        self._stream = _AbortableStream(self._file)
        self._zip: torch._C.PyTorchFileWriter | None = open_torch_save_writer(self._stream, compute_crc32=False)  # type: ignore[arg-type]
        self._crcs: dict[str, int] = {}
        self._items: list[tuple[ObjPath, Any]] = []
        self.tensor_bytes = 0

    def add_tensor(self, path: ObjPath, tensor: torch.Tensor, crc32: int | None = None) -> None:
        """Write ``tensor``'s storage record now; it appears at ``path`` in the loaded dict.

        Args:
            path: key path in the nested state dict (``("model", "layers.0.attn.wq.weight")``).
            tensor: CPU tensor of any shape and dtype; non-contiguous tensors are copied first.
            crc32: CRC-32 of the tensor's bytes if the caller has it (saves a pass over them).
        """
        assert self._zip is not None, "writer is closed"
        tensor = dense(tensor)
        key = str(len(self._items))
        self._crcs[f"data/{key}"] = zlib.crc32(byte_view(tensor)) if crc32 is None else crc32
        # the stub says Storage; torch.save passes an UntypedStorage here too
        with torch_call():
            self._zip.write_record(f"data/{key}", tensor.untyped_storage(), tensor.nbytes)  # type: ignore[arg-type]
        self._stream.raise_error()
        self.tensor_bytes += tensor.nbytes
        ref = _TensorRef(_StorageRef(key, tensor.dtype, tensor.numel()), tuple(tensor.shape))
        self._items.append((path, ref))

    def add_value(self, path: ObjPath, value: Any) -> None:
        """Record a plain Python value at ``path`` (pickled in ``finish``)."""
        self._items.append((path, value))

    def finish(self) -> int:
        """Write ``data.pkl`` and the trailer records, close the zip, flush and fsync.

        Returns:
            The file's size in bytes.
        """
        assert self._zip is not None, "writer is closed"
        buf = io.BytesIO()
        _Pickler(buf, protocol=PICKLE_PROTOCOL).dump(unflatten(self._items))
        data = buf.getvalue()
        alignment = str(storage_alignment())
        records = [("data.pkl", data)]
        records += [(name, text.encode()) for name, text in ((".format_version", "1"), (".storage_alignment", alignment))]
        records.append(("byteorder", sys.byteorder.encode()))
        with torch_call():
            for name, raw in records:
                self._crcs[name] = zlib.crc32(raw)
                self._zip.write_record(name, raw, len(raw))
            self._zip.write_end_of_file()
        self._stream.raise_error()
        self._zip = None
        self._file.flush()
        patch_crcs(self._file, self._crcs)
        return close_synced(self._file)

    def close(self) -> None:
        """Close the file without completing it; the caller removes it."""
        self._stream.abort()
        with torch_call():
            self._zip = None  # its destructor now writes into the void
        self._file.close()
