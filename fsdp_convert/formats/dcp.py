"""DCP folders (``FileSystemWriter``): index from ``.metadata``, payloads by byte range, CRC-32s checked.

Index: ``.metadata`` is unpickled safely and checked field by field (``_dcp_metadata``). A
folder that holds DCP folders (``_dcp_folders``) is read as one checkpoint whose data file names
carry their subfolder: accelerate's FSDP checkpoint folder (``pytorch_model_fsdp_0/`` +
``optimizer_0/``), OLMo-core's ``stepN/`` (its ``model_and_optim/``); torchtune's ``output/`` is
read as its newest ``dist_epoch_<n>/``. The names beside the data are recorded (``producers``
decides what they mean).

Reads: each payload (a torch.save zip, ``torch/distributed/checkpoint/filesystem.py``
``_write_item``) is decoded with ``torch.load(weights_only=True)`` from a ``ByteRangeFile`` over
its byte range of the data file: never the whole data file, and the tensor's storage is read
straight into the memory torch allocates for it. The zip's CRC-32s, which torch never checks, are
checked on the way (``check_crc``). A remote checkpoint reads each payload with one ranged GET.

``FileSystemWriter`` options that change the payloads (``_dcp_payloads``): a stream-transformed
(zstd) payload is decoded into memory first, at most what its chunk's shape allows (CRC-32s then
checked, its tensor mapped from those pages); tensors stored as a safetensors file
(``serialization_format=SAFETENSORS``) are indexed from its header and read as bare elements by
byte range.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import sys
from pathlib import Path
from typing import IO, Any, NoReturn, cast

from fsdp_convert.errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    MissingDataFileError,
    NotADcpCheckpointError,
    UnsafeContentError,
)
from fsdp_convert.formats._dcp_folders import (
    ACCELERATE_DIR_RE,
    OLMO_CORE_DIRNAME,
    dcp_folders_in,
    merge_indexes,
    metadata_subfolders,
)
from fsdp_convert.formats._dcp_metadata import build_index, load_metadata, records_from_bytes
from fsdp_convert.formats._dcp_payloads import BOTH_OPTIONS_HINT, is_raw_chunk, payload_formats
from fsdp_convert.formats._metadata_child import index_in_child
from fsdp_convert.formats._payload_pickle import plain_value, read_payload_tensor, whole_storage
from fsdp_convert.formats._payload_shapes import PayloadShapes, learn
from fsdp_convert.formats._range import ByteRangeFile, PayloadEdges, RecordHash
from fsdp_convert.formats._stream_transforms import DecodedPayload, bytes_limit_bytes, chunk_limit_bytes, decode_payload
from fsdp_convert.formats.index import MAX_ENTRIES, BytesEntry, CheckpointIndex, ChunkEntry, Location, TensorEntry, Url
from fsdp_convert.formats.reader import ChunkedReader, StoredBytes, check_payload, checked_value, read_bare_chunk
from fsdp_convert.held_roots import inside, open_inside, stat_inside
from fsdp_convert.location import mapped_inside
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.remote import as_location, read_bytes, read_range, size_of
from fsdp_convert.signals import torch_call
from fsdp_convert.zip_records import ZipFormatError, ZipRecord, read_records

__all__ = ["read_dcp_index", "load_metadata", "metadata_subfolders", "DcpReader", "payload_formats"]
__all__ += ["ACCELERATE_DIR_RE", "DCP_FILE_RE", "OLMO_CORE_DIRNAME"]

DCP_FILE_RE = re.compile(r"\.metadata|__\d+_\d+\.distcp")  # the files of a DCP folder (a whole name)


def read_dcp_index(checkpoint_id: str | os.PathLike[str]) -> CheckpointIndex:
    """Read a DCP checkpoint folder's ``.metadata`` (or accelerate's two folders') into a ``CheckpointIndex``.

    Reads ``.metadata`` only; data files are neither opened nor checked here, except the
    safetensors headers of chunks ``FileSystemWriter(serialization_format=SAFETENSORS)`` wrote
    (a few KB each; see ``_dcp_payloads``).

    Args:
        checkpoint_id: the checkpoint folder (the one holding ``.metadata``), accelerate's, OLMo-core's
            ``stepN/``, or torchtune's ``output/`` (read as its newest ``dist_epoch_<n>/``).

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotADcpCheckpointError: no ``.metadata`` in the folder, or it is malformed; two torchtune
            folders of the newest epoch.
        UnsafeContentError: ``.metadata`` would run code when unpickled, or a file the index
            reads (``.metadata``, a data file) is a symbolic link out of the folder
            (``location.inside``; the process's ``following_symlinks`` setting allows it).
        MissingDataFileError, CorruptChunkError: a data file holding safetensors-stored chunks
            is missing, or its safetensors header is unreadable.
    """
    location = as_location(checkpoint_id)
    if isinstance(location, Url):  # object storage: .metadata is read whole, chunks later by range
        meta_url = location / METADATA_FILENAME
        if size_of(meta_url) is None:
            raise NotADcpCheckpointError(f"{location} has no {METADATA_FILENAME}; not a DCP checkpoint")
        return _build(records_from_bytes(read_bytes(meta_url), meta_url), location)
    root = location
    if not root.exists():
        raise CheckpointNotFoundError(f"{root} does not exist")
    if not root.is_dir():
        raise NotADcpCheckpointError(f"{root} is not a folder; a DCP checkpoint is a folder with {METADATA_FILENAME}")
    meta_path = root / METADATA_FILENAME
    if not meta_path.is_file():
        return _read_parent_folder(root)
    return _with_beside(_index_of(root, root))


def _with_beside(index: CheckpointIndex) -> CheckpointIndex:
    """``index`` with the names beside its data in its folder (``beside``, ``links_out``); none where it cannot be listed."""
    root = index.checkpoint_id
    assert isinstance(root, Path)
    known = {*index.folders, *index.data_files}
    try:
        beside = frozenset(n for n in os.listdir(root) if n not in known and not DCP_FILE_RE.fullmatch(n))
    except OSError:
        return index
    links_out = set()
    for name in beside:  # as the process's setting allows (location.inside)
        try:
            inside(root, root / name)
        except UnsafeContentError:
            links_out.add(name)
    return dataclasses.replace(index, beside=beside, links_out=frozenset(links_out))


def _index_of(root: Path, folder: Path) -> CheckpointIndex:
    """``folder``'s ``.metadata`` indexed, mapped by ``location.open_inside`` (never by name after a check).

    A large one is unpickled at C speed in a forked child (``_metadata_child``); the restricted
    interpreter (``records_from_bytes``) reads the rest, and names what is wrong with a file the
    child does not take.
    """
    path = folder / METADATA_FILENAME
    with contextlib.ExitStack() as stack:
        try:
            data = stack.enter_context(mapped_inside(root, path))
        except (OSError, CorruptChunkError) as e:  # missing, unreadable, or not a regular file
            raise NotADcpCheckpointError(f"cannot read {path}: {getattr(e, 'strerror', None) or 'not a regular file'}") from e
        index = index_in_child(data, folder, lambda metadata: _build(metadata, folder))
        return index if index is not None else _build(records_from_bytes(data, path), folder)


def _build(metadata: Any, folder: Location) -> CheckpointIndex:
    """``build_index`` with reads of ``folder``'s data files (local or remote), for safetensors-stored chunks."""

    def read_at(relative_path: str, offset: int, length: int) -> bytes:
        if isinstance(folder, Url):
            return read_range(folder / relative_path, offset, length)
        path = folder / relative_path
        try:
            with open(open_inside(folder, path), "rb") as f:
                return os.pread(f.fileno(), length, offset)
        except OSError as e:
            raise MissingDataFileError(f"cannot open {path}: {e.strerror}") from e

    def size_in_bytes(relative_path: str) -> int:
        if isinstance(folder, Url):
            size = size_of(folder / relative_path)
            if size is None:
                raise MissingDataFileError(f"cannot open {folder / relative_path}: No such object")
            return size
        try:
            return stat_inside(folder, folder / relative_path).st_size  # by the walk, not by name after a check
        except OSError as e:
            raise MissingDataFileError(f"cannot open {folder / relative_path}: {e.strerror}") from e

    index = build_index(metadata, folder, read_at=read_at, size_of=size_in_bytes)
    if len(index.entries) > MAX_ENTRIES:  # the rest of the pipeline is linear in them, but not free
        raise NotADcpCheckpointError(f"{folder / METADATA_FILENAME}: more than {MAX_ENTRIES} entries; not a checkpoint's")
    return index


def _read_parent_folder(root: Path) -> CheckpointIndex:
    """A folder without ``.metadata``: the DCP folders inside it (``_dcp_folders.dcp_folders_in``) read as one checkpoint."""
    folders = dcp_folders_in(root)
    if isinstance(folders, Path):  # torchtune's newest epoch: the checkpoint itself
        return read_dcp_index(folders)
    return _with_beside(merge_indexes(root, [_index_of(root, d) for d in folders]))


class DcpReader(ChunkedReader):
    """Reads the payloads of a DCP folder (or accelerate's parent folder), one open descriptor per data file.

    Use as a context manager; ``close`` releases the descriptors. One reader per thread.

    Args:
        checkpoint_id: the checkpoint folder, local or an fsspec URL.
        check_crc: check every zip record's CRC-32 of every payload read (torch.load does not).
        follow_symlinks: as ``ChunkedReader``'s.
    """

    def __init__(
        self, checkpoint_id: str | os.PathLike[str] | Location, *, check_crc: bool = True, follow_symlinks: bool | None = None
    ) -> None:
        super().__init__(checkpoint_id, check_crc=check_crc, follow_symlinks=follow_symlinks)
        self._shapes = PayloadShapes()  # each payload zip parsed once per shape (``_payload_shapes``)

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> StoredBytes | None:
        """The storage record of a chunk's payload, found without decoding its data.

        The payload's zip records are parsed from its two ends (``PayloadEdges``); its ``data.pkl``
        is read as an inert record (``_payload_pickle``, no torch) and checked against ``.metadata``
        (dtype, shape); with CRC checking on, every other record's CRC-32 is checked here and the
        storage's is returned to check as its bytes pass. A payload whose tensor is not its one storage whole and in C
        order (a view torch.save kept with its base) is left to ``read_chunk``.

        A chunk ``FileSystemWriter(serialization_format=SAFETENSORS)`` stored (``_dcp_payloads``)
        is its bare elements at the byte range the index gives it: returned as is, with no CRC-32
        (safetensors stores none).

        Returns:
            The storage bytes, or None for a remote checkpoint, a stream-transformed payload or a view.

        Raises:
            MissingDataFileError, CorruptChunkError, UnsafeContentError, ShapeMismatchError: as ``read_chunk``.
        """
        if chunk.relative_path is None or chunk.transform_descriptors or not isinstance(self.root, Path):
            return None
        where = self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
        fd, at = self._range(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, where)
        if is_raw_chunk(entry, chunk):
            self._log_read(entry, chunk)
            return StoredBytes(fd=fd, offset=at, nbytes=chunk.length_bytes, crc32=None, where=where)
        edges = PayloadEdges(fd, at, chunk.length_bytes)
        claim = (entry.dtype_name, chunk.sizes, chunk.numel * entry.itemsize)
        found = self._shapes.storage_of(edges.pread, chunk.length_bytes, edges.whole, claim, self.check_crc)
        if found is not None:  # the bytes of a payload parsed before, but its storage's data and CRC-32s
            self._log_read(entry, chunk)
            return StoredBytes(fd=fd, offset=at + found[0], nbytes=found[1], crc32=found[2], where=where)
        try:
            records = read_records(edges.pread, chunk.length_bytes)
        except ZipFormatError as e:
            raise CorruptChunkError(f"{where}: payload is not a torch.save zip ({e})") from e
        named = [(r.short_name, r) for r in records]  # each name split once (millions of payloads)
        storages = [r for name, r in named if name.startswith("data/")]
        pickles = [r for name, r in named if name == "data.pkl"]
        if len(storages) != 1 or len(pickles) != 1 or any(r.compression for r in records):
            return None
        order = [r for name, r in named if name == "byteorder"]
        if order and edges.pread(order[0].size, order[0].data_offset) != sys.byteorder.encode():
            return None  # torch.load byte-swaps these; read_chunk does
        storage = storages[0]
        if self.check_crc:  # every record but the storage, whose CRC-32 the mover checks as its bytes pass
            self._check_crcs(edges.crc_mismatches([r for r in records if r is not storage]), where)
        tensor = read_payload_tensor(edges.pread(pickles[0].size, pickles[0].data_offset))
        if tensor is not None and (tensor.dtype_name, tensor.sizes) == (entry.dtype_name, chunk.sizes):
            plain = whole_storage(tensor, storage)
        else:  # a pickle of another shape: torch's loader reads it and names the fault
            plain = self._whole_meta(ByteRangeFile(fd, at, chunk.length_bytes), entry, chunk, storage, where)
            tensor = None
        if not plain or storage.size != chunk.numel * entry.itemsize:
            return None
        if tensor is not None:  # payloads of this shape are matched against this one's bytes from now on
            self._shapes.add(learn(edges.pread, chunk.length_bytes, records, storage, tensor))
        self._log_read(entry, chunk)
        checked = storage.crc32 if self.check_crc else None
        return StoredBytes(fd=fd, offset=at + storage.data_offset, nbytes=storage.size, crc32=checked, where=where)

    def _load_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> Any:
        assert chunk.relative_path is not None
        if is_raw_chunk(entry, chunk):  # bare elements (serialization_format=SAFETENSORS)
            where = self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
            return read_bare_chunk(
                *self._range(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, where), entry, chunk, where
            )
        args = (chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, chunk.transform_descriptors)
        elements_long = chunk.length_bytes == chunk.numel * entry.dtype.itemsize
        return self._load(*args, entry.fqn, chunk_limit_bytes(entry, chunk), BOTH_OPTIONS_HINT if elements_long else "")

    def _decode(
        self, relative_path: str, offset: int, length: int, transforms: tuple[str, ...], where: str, limit: int, hint: str = ""
    ) -> DecodedPayload:
        """A stream-transformed payload's torch.save zip, decoded into memory (``_dcp_payloads.decode_payload``).

        Raises:
            MissingDataFileError, CorruptChunkError (truncated file, undecodable stream, or one that decodes to
                more than ``limit`` bytes), UnsupportedTransformError, CheckpointError (no memory for ``limit``).
        """
        fd, at = self._range(relative_path, offset, length, where)
        return decode_payload(cast(IO[bytes], ByteRangeFile(fd, at, length)), transforms, where, limit, hint)

    def _load(
        self, relative_path: str, offset: int, length: int, transforms: tuple[str, ...], fqn: str, limit: int, hint: str = ""
    ) -> Any:
        """Decode the torch.save payload at a byte range (undoing any stream transform) with ``weights_only=True``.

        ``hint`` ends the message when a stream-transformed payload decodes to nothing.
        """
        where = self._where(relative_path, offset, length, fqn)
        if transforms:  # decoded into memory, at most ``limit`` bytes; the tensor's storage is mapped from those pages
            with self._decode(relative_path, offset, length, transforms, where, limit, hint) as decoded:
                if self.check_crc:
                    decoded.check_crcs(where)
                try:
                    return decoded.load()
                except Exception as e:
                    self._raise_decode_error(e, where)
        fd, at = self._range(relative_path, offset, length, where)
        if (plain := plain_value(PayloadEdges(fd, at, length), length, self.check_crc)) is not None:
            self._check_crcs(plain[1], where)
            return plain[0]  # no tensor in it: read without torch
        payload = ByteRangeFile(fd, at, length)
        if self.check_crc:
            try:
                payload.hashes = [RecordHash(r) for r in read_records(payload.pread, length)]
            except ZipFormatError as e:
                raise CorruptChunkError(f"{where}: payload is not a torch.save zip ({e})") from e
        try:
            import torch

            with torch_call():
                value = torch.load(cast(IO[bytes], payload), map_location="cpu", weights_only=True)
        except Exception as e:
            if payload.error is not None:
                raise payload.error from None  # the read failed or was interrupted: that is the cause
            self._check_crcs(payload.finish_crcs(), where)  # a corrupt record explains a decode failure best
            self._raise_decode_error(e, where)
        if payload.error is not None:
            raise payload.error
        self._check_crcs(payload.finish_crcs(), where)
        return value

    def _whole_meta(self, payload: ByteRangeFile, entry: TensorEntry, chunk: ChunkEntry, storage: ZipRecord, where: str) -> bool:
        """``whole_storage`` by torch's loader (on the meta device: the pickle alone), checked against ``.metadata``."""
        try:
            import torch

            with torch_call():
                meta = torch.load(cast(IO[bytes], payload), map_location="meta", weights_only=True)
        except Exception as e:
            if payload.error is not None:
                raise payload.error from None
            self._raise_decode_error(e, where)
        if payload.error is not None:
            raise payload.error
        check_payload(entry, chunk, meta, where)
        return bool(meta.is_contiguous() and meta.storage_offset() == 0 and meta.untyped_storage().nbytes() == storage.size)

    @staticmethod
    def _check_crcs(mismatches: list[tuple[ZipRecord, int]], where: str) -> None:
        if mismatches:  # the record's name, stored CRC-32 and the CRC-32 of its bytes are all the file's: not quoted
            raise CorruptChunkError(f"{where}: CRC-32 mismatch in a record of its torch.save zip; the data file is corrupt")

    @staticmethod
    def _raise_decode_error(e: Exception, where: str) -> NoReturn:
        if isinstance(e, pickle.UnpicklingError):
            # torch wraps every weights-only refusal in one message; the line naming the global
            # tells a hostile payload from a broken one.
            detail = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), None)
            if detail is not None:
                raise UnsafeContentError(f"{where}: payload would run code, refused ({detail})") from e
            raise CorruptChunkError(f"{where}: payload does not decode as a torch.save object") from e
        # zip structure broken, truncated record
        raise CorruptChunkError(f"{where}: payload does not decode ({type(e).__name__}: {_first_line(e)})") from e

    def read_raw(self, entry: BytesEntry) -> bytes:
        """A bytes entry's torch.save payload as stored (to carry it over unchanged), any stream transform undone.

        Raises:
            MissingDataFileError, CorruptChunkError (truncated file), UnsupportedTransformError.
        """
        self.read_value(entry)  # decode once: refuses a hostile or corrupt payload before it is copied
        where = self._where(entry.relative_path, entry.offset_bytes, entry.length_bytes, entry.fqn)
        args = (entry.relative_path, entry.offset_bytes, entry.length_bytes, entry.transform_descriptors)
        if entry.transform_descriptors:
            with self._decode(*args, where, bytes_limit_bytes(entry)) as decoded:
                return os.pread(decoded.fd, decoded.nbytes, 0)
        fd, at = self._range(entry.relative_path, entry.offset_bytes, entry.length_bytes, where)
        return os.pread(fd, entry.length_bytes, at)

    def read_value(self, entry: BytesEntry) -> Any:
        """Decode a bytes entry: the plain Python value (float, tuple, list of FQNs, ...).

        Raises:
            MissingDataFileError, CorruptChunkError, UnsupportedTransformError, UnsafeContentError.
            CorruptChunkError: also a value nested too deep or holding itself (``reader.checked_value``).
        """
        args = (entry.relative_path, entry.offset_bytes, entry.length_bytes, entry.transform_descriptors)
        return checked_value(self._load(*args, entry.fqn, bytes_limit_bytes(entry)), self._where(*args[:3], entry.fqn))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
