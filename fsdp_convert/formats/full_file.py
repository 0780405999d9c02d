"""Read stage for full (unsharded) checkpoints: a torch.save or safetensors file, a Hugging Face or PEFT folder.

Every output of ``consolidate`` is one; each is opened as a flat view of its files
(``formats.file_views``: ``TorchSaveView``, ``SafetensorsView``), indexed as one whole-tensor
chunk per tensor (``file_index``) and read through ``FileBoxReader``, which slices the stored
tensor. A torch.save zip is first read without torch (``TorchSaveRecords``: its pickle as records
of where each tensor lies), so its index needs no torch and ``FileBoxReader.locate`` gives a
contiguous tensor's bytes to move or compare undecoded; torch loads it (memory-mapped) only for a
tensor read as a tensor, and whole for a file those records do not cover. Safetensors names get a
``model.`` prefix in the flat view, which ``file_index`` drops for weights alone (as
``model.state_dict()`` has them) and keeps beside a folder's ``optimizer.pt``.
A file's format comes from its first bytes (``file_reads.sniff_file``), so a torch.save file under
any name (``.ckpt``) is read. A folder is an output of this tool when it holds a file of a folder
row of the outputs table (``output_table.folder_files``).
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_convert.dtypes import DType, as_dtype, is_tensor
from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError
from fsdp_convert.formats._pt_records import StoredTensor
from fsdp_convert.formats.file_reads import sniff_file
from fsdp_convert.formats.file_views import MODEL_PREFIX, FullFileView, SafetensorsView, TorchSaveRecords, TorchSaveView
from fsdp_convert.formats.index import (
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    Location,
    Mark,
    ObjPath,
    TensorEntry,
    flatten_with_paths,
)
from fsdp_convert.formats.reader import StoredBytes
from fsdp_convert.output_table import (
    ADAPTER_WEIGHTS_FILENAME,
    METADATA_FILENAME,
    OPTIMIZER_FILENAME,
    folder_files,
    suffixes_holding,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "MODEL_PREFIX",  # from formats.file_views, as the views below
    "ADAPTER_WEIGHTS_FILENAME",  # from output_table
    "TorchSaveView",
    "SafetensorsView",
    "FullFileView",
    "flatten_with_paths",  # from formats.index
    "is_hf_folder",
    "is_full_checkpoint",
    "open_full_file",
    "FileBoxReader",
    "file_index",
]

# the views' former names, until ops/verify.py and ops/_sources.py use the new ones
TorchSaveFile, SafetensorsFiles, FullFile = TorchSaveView, SafetensorsView, FullFileView


def is_hf_folder(path: Path) -> bool:
    """A folder with no ``.metadata`` that holds what ``consolidate`` writes to a folder.

    That is any file of a folder row of the outputs table (``output_table.folder_files``): Hugging
    Face weights (``model.safetensors.index.json``, ``model.safetensors``), a PEFT adapter
    (``adapter_model.safetensors``), or an ``optimizer.pt`` or ``extra_state.pt``.
    """
    return not (path / METADATA_FILENAME).is_file() and any((path / f.name).is_file() for f in folder_files())


def is_full_checkpoint(location: Location) -> bool:
    """True for a local file, or a Hugging Face or PEFT folder (see ``is_hf_folder``; not a DCP folder)."""
    return isinstance(location, Path) and (location.is_file() or is_hf_folder(location))


def open_full_file(path: Path, *, optimizer_key: str = "optim") -> FullFileView:
    """Open a full checkpoint by what the path holds.

    A folder (see ``is_hf_folder``), with ``optimizer.pt`` (under ``optimizer_key``) and ``extra_state.pt``;
    a file by its first bytes (``file_reads.sniff_file``: a torch.save zip or legacy pickle, or safetensors),
    whatever its name, else by the suffixes of the file rows holding each
    (``output_table.suffixes_holding``): ``.pt``/``.pth``/``.bin`` torch.save, ``.safetensors``.

    Raises:
        NotADcpCheckpointError: an unknown file type, or a folder with none of those files.
        CorruptChunkError: an unreadable file.
        UnsafeContentError: a pickle that would run code.
        CheckpointNotFoundError: a shard named by a folder's index is missing.
    """
    if path.is_dir():
        folder = SafetensorsView.from_folder(path)
        folder.add_side_files(optimizer_key)
        if not folder.keys() and not folder.sides:
            raise NotADcpCheckpointError(f"{path}: no .metadata and no weights or {OPTIMIZER_FILENAME}; not a checkpoint")
        return folder
    suffix = path.suffix.lower()
    kind = sniff_file(path)
    if kind == "torch_save":  # a zip: its pickle read without torch where it can be (TorchSaveRecords)
        return TorchSaveRecords.open(path) or TorchSaveView(path)
    if kind == "legacy_torch_save" or (kind is None and suffix in suffixes_holding("torch_save")):
        return TorchSaveView(path)
    if kind == "safetensors" or suffix in suffixes_holding("safetensors"):
        return SafetensorsView.from_files(path, [path], "safetensors")
    raise NotADcpCheckpointError(f"{path}: unknown checkpoint file type {path.suffix!r} (not torch.save or safetensors)")


# A torch.save file's pickle is read whole (as records, or unpickled with its storages mapped): the
# view ``file_index`` read is handed to the first reader of the same file (same device, inode, size
# and mtime) in this process, so that indexing a file and reading it there (``verify``'s two sides,
# a run in one process) reads it once. At most _HANDED_MAX views wait; the oldest is closed for a new one.
_HANDED_MAX = 4
_TorchSave = TorchSaveView | TorchSaveRecords
_handed: dict[Path, tuple[tuple[int, int, int, int], _TorchSave]] = {}
_handed_lock = threading.Lock()


def _stamp(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _hand_over(path: Path, view: _TorchSave) -> None:
    """Keep ``view`` for the next reader of ``path`` in this process (closing any view kept too long)."""
    with _handed_lock:
        stale = [_handed.pop(path, (None, None))[1]]
        _handed[path] = (_stamp(path), view)
        while len(_handed) > _HANDED_MAX:
            stale.append(_handed.pop(next(iter(_handed)))[1])
    for old in stale:
        if old is not None:
            old.close()


def _take_over(path: Path) -> _TorchSave | None:
    """The view ``file_index`` loaded of ``path``, if it is still the same file; None otherwise."""
    with _handed_lock:
        stamp, view = _handed.pop(path, (None, None))
    if view is None:
        return None
    try:
        if _stamp(path) == stamp:
            return view
    except OSError:
        pass
    view.close()
    return None


class FileBoxReader:
    """Boxes of the tensors of a full (unsharded) checkpoint (``open_full_file``), for ``consolidate`` and ``reshard``.

    Its index (``file_index``) has one whole-tensor chunk per tensor and no data files, so a
    chunk, a full tensor and a box are all copies of slices of the one stored tensor.

    Args:
        path: the source.
        check_crc: unused (nothing here stores CRC-32s); kept for the shared ``Reader`` signature.

    Raises:
        As ``open_full_file``.
    """

    def __init__(self, path: str | os.PathLike[str] | Location, *, check_crc: bool = True) -> None:
        path = Path(path)
        self._source: FullFileView = _take_over(path) or open_full_file(path)

    def __enter__(self) -> FileBoxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the memory maps and open safetensors files."""
        self._source.close()

    def read_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> torch.Tensor:
        """The box of ``chunk`` (``file_index``'s one chunk is the whole tensor), as a new contiguous tensor."""
        return self.read_box(entry, chunk.offsets, chunk.sizes)

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> StoredBytes | None:
        """Where a tensor's elements lie in its file, as they are: a safetensors tensor, or a contiguous torch.save one.

        ``chunk`` is the entry's one whole-tensor chunk (``file_index``). No CRC-32 comes with the
        bytes (a torch.save zip's covers the whole storage, which may hold other tensors too). None
        for a tensor stored otherwise (a view with strides of its own, a big-endian machine's
        safetensors) or a file torch loads whole: ``read_chunk`` reads those.

        Raises:
            CorruptChunkError: the stored tensor is not the one the index describes (the file changed).
            UnsafeContentError: a safetensors file of a folder is a symbolic link out of it.
        """
        return self._located(entry) if chunk.sizes == entry.shape else None

    def _located(self, entry: TensorEntry) -> StoredBytes | None:
        """``locate`` of the entry's whole tensor."""
        source = self._source
        if isinstance(source, SafetensorsView):
            located = source.located(self._key(entry.fqn))
            if located is None:
                return None
            fd, at, nbytes, file = located
            return StoredBytes(
                fd=fd, offset=at, nbytes=nbytes, crc32=None, where=f"{file} bytes [{at}, {at + nbytes}) ({entry.fqn})"
            )
        if not isinstance(source, TorchSaveRecords):
            return None
        stored = source.stored(self._key(entry.fqn))
        if not isinstance(stored, StoredTensor) or (stored.dtype_name, stored.shape) != (entry.dtype_name, entry.shape):
            raise CorruptChunkError(f"{entry.fqn}: the stored value is not a {entry.dtype} {list(entry.shape)}; did it change?")
        where = stored.byte_range()
        if where is None:
            return None
        at, nbytes = where
        return StoredBytes(
            fd=source.fd, offset=at, nbytes=nbytes, crc32=None, where=f"{source.path} bytes [{at}, {at + nbytes}) ({entry.fqn})"
        )

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor of ``entry``, contiguous, shape ``entry.shape``.

        The stored tensor itself when it is contiguous (memory-mapped: read it, do not write to
        it), else a contiguous copy.

        Raises:
            CorruptChunkError: the stored value is not the tensor the index describes (the file changed).
        """
        tensor = self._stored(entry)
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def read_box(self, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` (elements) of the tensor, as a new contiguous tensor.

        Raises:
            CorruptChunkError: the stored value is not the tensor the index describes (the file changed).
        """
        rows = self._read_rows(entry, offsets, sizes)
        if rows is not None:
            return rows
        tensor = self._stored(entry)
        for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
            tensor = tensor.narrow(dim, o, n)
        return tensor.contiguous().clone()

    def _read_rows(self, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        """A box of whole rows of a tensor whose elements lie in the file as they are: only those rows' bytes read.

        None when the tensor is not so located or the box cuts a dimension past the first: the
        stored tensor is read instead (safetensors, memory-mapped torch.save).

        Raises:
            CorruptChunkError: a short read (the file changed while it was read).
        """
        import torch

        if not entry.shape or tuple(sizes[1:]) != entry.shape[1:] or any(offsets[1:]):
            return None
        stored = self._located(entry)
        if stored is None:
            return None
        row = stored.nbytes // entry.shape[0] if entry.shape[0] else 0
        buffer = bytearray(row * sizes[0])
        view, at, done = memoryview(buffer), stored.offset + row * offsets[0], 0
        while done < len(buffer):
            got = os.preadv(stored.fd, [view[done:]], at + done)
            if got <= 0:
                raise CorruptChunkError(f"{stored.where}: short read; the file changed while it was read")
            done += got
        if not buffer:
            return torch.empty(sizes, dtype=entry.dtype.torch)
        return torch.frombuffer(buffer, dtype=entry.dtype.torch).reshape(sizes)

    def _stored(self, entry: TensorEntry) -> torch.Tensor:
        """The stored tensor of ``entry``, checked against the index.

        Raises:
            CorruptChunkError: the stored value is not the tensor the index describes (the file changed).
        """
        tensor = self._source.get(self._key(entry.fqn))
        if not is_tensor(tensor) or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise CorruptChunkError(f"{entry.fqn}: the stored value is not a {entry.dtype} {list(entry.shape)}; did it change?")
        return tensor

    def _key(self, fqn: str) -> str:
        # model weights alone are indexed without their model. level (see file_index)
        return MODEL_PREFIX + fqn if self._source.model_only else fqn

    def read_value(self, entry: BytesEntry) -> Any:
        """A plain value of the file (param group field, train state)."""
        return self._source.get(self._key(entry.fqn))

    def read_raw(self, entry: BytesEntry) -> bytes:
        """The value as DCP stores a bytes entry: its torch.save payload."""
        import torch

        buf = io.BytesIO()
        torch.save(self.read_value(entry), buf)
        return buf.getvalue()


def file_index(path: str | os.PathLike[str]) -> CheckpointIndex:
    """An index for a full checkpoint: one whole-tensor chunk per tensor, in the file's order.

    Keys and paths follow DCP's flattening. Safetensors weights alone (a file, a folder without
    ``optimizer.pt`` or ``extra_state.pt``, a PEFT adapter) stand alone, as ``model.state_dict()``
    has them (marked ``weights_alone``); beside a folder's side files they go under ``model``, the optimizer under ``optim``,
    ``extra_state.pt``'s at the top: ``consolidate``'s nested layout (no data files: world size 0).

    Raises:
        As ``open_full_file``.
    """
    p = Path(path)
    source = open_full_file(p)
    entries: list[Entry] = []
    handed = False
    try:
        if isinstance(source, SafetensorsView):
            for name, dtype, shape in source.tensors():  # from the headers: no data read
                fqn, obj_path = (name, (name,)) if source.model_only else (MODEL_PREFIX + name, ("model", name))
                entries.append(_whole_tensor(fqn, obj_path, dtype, shape))
        for side in [source] if isinstance(source, (TorchSaveView, TorchSaveRecords)) else source.sides:
            for key, (value_path, value) in side.flat_with_paths.items():
                if isinstance(value, StoredTensor):  # recorded without torch (TorchSaveRecords)
                    entries.append(_whole_tensor(key, value_path, as_dtype(value.dtype_name), value.shape))
                elif is_tensor(value):
                    entries.append(_whole_tensor(key, value_path, value.dtype, tuple(value.shape)))
                else:
                    entries.append(BytesEntry(fqn=key, path=value_path, relative_path="", offset_bytes=0, length_bytes=0))
        if isinstance(source, (TorchSaveView, TorchSaveRecords)):
            _hand_over(p, source)  # its reader in this process takes it: the file is loaded once
            handed = True
    finally:
        if not handed:
            source.close()
    alone = isinstance(source, SafetensorsView) and source.model_only
    marks: frozenset[Mark] = frozenset({"weights_alone"}) if alone else frozenset()
    return CheckpointIndex(checkpoint_id=p, entries=tuple(entries), data_files=(), marks=marks)


def _whole_tensor(fqn: str, path: ObjPath, dtype: torch.dtype | DType, shape: tuple[int, ...]) -> TensorEntry:
    whole = ChunkEntry(offsets=(0,) * len(shape), sizes=shape, relative_path=None, offset_bytes=0, length_bytes=0)
    return TensorEntry(fqn=fqn, path=path, shape=shape, dtype=dtype, chunks=(whole,))
