"""Read stage for full (unsharded) checkpoints: a torch.save file, a safetensors file, a Hugging Face folder.

Each is indexed as one whole-tensor chunk per tensor (``file_index``) and read through
``FileBoxReader``, which slices the memory-mapped tensor, so ``reshard`` can lay a full
checkpoint out for any world size. Keys follow DCP's flattening
(``torch/distributed/checkpoint/_traverse.py``: dicts always, lists only when they hold tensors or
containers); safetensors names get a ``model.`` prefix in the flat view (``TorchSaveFile``,
``SafetensorsFiles``), which ``file_index`` drops. Nothing is loaded whole: torch.save files are
memory-mapped, safetensors are read per tensor.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fsdp_convert.constants import (
    EXTRA_STATE_FILENAME,
    HF_INDEX_FILENAME,
    HF_SINGLE_FILENAME,
    METADATA_FILENAME,
    OPTIMIZER_FILENAME,
    SAFETENSORS_SUFFIXES,
    SAFETENSORS_TO_TORCH,
    TORCH_SAVE_SUFFIXES,
    torch_shape,
)
from fsdp_convert.errors import CheckpointNotFoundError, CorruptChunkError, NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.formats.index import (
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    Location,
    ObjPath,
    TensorEntry,
    dcp_key,
)

__all__ = [
    "MODEL_PREFIX",
    "TorchSaveFile",
    "SafetensorsFiles",
    "FullFile",
    "flatten_with_paths",
    "is_hf_folder",
    "is_full_checkpoint",
    "open_full_file",
    "FileBoxReader",
    "file_index",
]

MODEL_PREFIX = "model."


def flatten_with_paths(obj: Mapping[str, Any]) -> dict[str, tuple[ObjPath, Any]]:
    """Flatten a nested state dict as DCP's ``flatten_state_dict`` does: dotted key -> (path, value).

    The path is the value's place in the nested dict, as DCP records it in ``planner_data``.
    """
    flat: dict[str, tuple[ObjPath, Any]] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not terminal(v)) for v in value)

    def visit(path: ObjPath, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif terminal(value):
            flat[dcp_key(path)] = (path, value)
        else:
            for i, v in enumerate(value):
                visit((*path, i), v)

    for key, value in obj.items():
        visit((str(key),), value)
    return flat


class TorchSaveFile:
    """A torch.save file as flat keys, loaded with ``weights_only=True, mmap=True`` (nothing is copied).

    Args:
        path: the file.
        prefix: path elements to nest the loaded dict under (``("optim",)`` for an HF folder's
            ``optimizer.pt``, which holds the optimizer state dict itself).

    Raises:
        UnsafeContentError: a pickle that would run code.
        CorruptChunkError: not a readable torch.save file.
        NotADcpCheckpointError: it holds something other than a dict.
    """

    kind = "torch_save"
    model_only = False

    def __init__(self, path: Path, prefix: tuple[str, ...] = ()) -> None:
        self.path = path
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            detail = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), None)
            if detail is not None:
                raise UnsafeContentError(f"{path}: would run code when loaded, refused ({detail})") from e
            raise CorruptChunkError(f"{path}: not a readable torch.save file ({type(e).__name__})") from e
        if not isinstance(obj, Mapping):
            raise NotADcpCheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict")
        for top in reversed(prefix):  # optimizer.pt holds the optimizer state dict itself
            obj = {top: obj}
        self.flat_with_paths = flatten_with_paths(obj)
        self._flat = {key: value for key, (_, value) in self.flat_with_paths.items()}

    def keys(self) -> list[str]:
        """Every flat key, in the file's order."""
        return list(self._flat)

    def __contains__(self, key: str) -> bool:
        return key in self._flat

    def get(self, key: str) -> Any:
        """The value of ``key``: a memory-mapped CPU tensor or a plain value."""
        return self._flat[key]

    def close(self) -> None:
        """Drop the references to the memory map."""
        self._flat = {}
        self.flat_with_paths = {}


class SafetensorsFiles:
    """One safetensors file, or a Hugging Face folder's shards, as flat ``model.<name>`` keys.

    A folder's ``optimizer.pt`` and ``extra_state.pt`` come in through ``add_side_files``.

    Args:
        path: the file or folder.
        files: tensor name -> the file holding it.
        kind: ``safetensors`` (a file) or ``hf_dir`` (a folder).
    """

    model_only = True

    def __init__(self, path: Path, files: dict[str, Path], kind: str) -> None:
        self.path, self.kind = path, kind
        self._files = files  # tensor name -> file
        self._open: dict[Path, Any] = {}
        self._sides: list[TorchSaveFile] = []

    @classmethod
    def from_file(cls, path: Path) -> SafetensorsFiles:
        """One safetensors file (its header is read now).

        Raises:
            Exception: whatever ``safetensors.safe_open`` raises for an unreadable file.
        """
        with safe_open(path, "pt") as f:
            names = list(f.keys())
        return cls(path, {n: path for n in names}, "safetensors")

    @classmethod
    def from_folder(cls, path: Path) -> SafetensorsFiles:
        """A Hugging Face folder: ``model.safetensors.index.json``'s shards, or ``model.safetensors``.

        Raises:
            NotADcpCheckpointError: an index without a ``weight_map``.
            CheckpointNotFoundError: a shard the index names is missing (or outside the folder).
        """
        index_path = path / HF_INDEX_FILENAME
        if index_path.is_file():
            index = json.loads(index_path.read_text())
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise NotADcpCheckpointError(f"{index_path} has no weight_map")
            files = {str(k): path / str(v) for k, v in weight_map.items()}
            for f in set(files.values()):
                if f.parent != path or not f.is_file():
                    raise CheckpointNotFoundError(f"{f} (named in {index_path}) is missing")
            return cls(path, files, "hf_dir")
        return cls(path, cls.from_file(path / HF_SINGLE_FILENAME)._files, "hf_dir")

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            self._open[file] = safe_open(file, "pt")
        return self._open[file]

    def keys(self) -> list[str]:
        """Every flat key: ``model.<name>`` per tensor, then the side files' keys."""
        return [MODEL_PREFIX + n for n in self._files] + [k for side in self._sides for k in side.keys()]

    def get(self, key: str) -> Any:
        """The value of ``key``; a tensor is read from its file now (a new CPU tensor)."""
        for side in self._sides:
            if key in side:
                return side.get(key)
        name = key.removeprefix(MODEL_PREFIX)
        return self._handle(self._files[name]).get_tensor(name)

    def add_side_files(self) -> None:
        """A Hugging Face folder's ``optimizer.pt`` (as ``optim``) and ``extra_state.pt``, if present."""
        for filename, prefix in ((OPTIMIZER_FILENAME, ("optim",)), (EXTRA_STATE_FILENAME, ())):
            if (self.path / filename).is_file():
                self._sides.append(TorchSaveFile(self.path / filename, prefix))
        self.model_only = not self._sides

    def describe(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """Dtype and shape (torch elements) of ``key`` from the file header alone (no tensor data is read).

        The dtype comes from ``constants.SAFETENSORS_TO_TORCH``, the shape through
        ``constants.torch_shape`` (an ``F4`` header counts 4-bit values, two per element).

        Raises:
            NotADcpCheckpointError: a dtype name not in the table, or an ``F4`` shape that does not
                fill whole bytes.
        """
        name = key.removeprefix(MODEL_PREFIX)
        file = self._files[name]
        view = self._handle(file).get_slice(name)
        dtype = SAFETENSORS_TO_TORCH.get(view.get_dtype())
        if dtype is None:
            raise NotADcpCheckpointError(
                f"{file}: {name} has safetensors dtype {view.get_dtype()!r}, which this tool does not read"
            )
        try:
            return dtype, torch_shape(dtype, view.get_shape())
        except ValueError as e:
            raise NotADcpCheckpointError(f"{file}: {name}: {e}") from e

    def close(self) -> None:
        """Close every open file."""
        self._open.clear()
        for side in self._sides:
            side.close()


FullFile = TorchSaveFile | SafetensorsFiles


def is_hf_folder(path: Path) -> bool:
    """A folder with ``model.safetensors.index.json`` or ``model.safetensors`` and no ``.metadata``."""
    return not (path / METADATA_FILENAME).is_file() and any(
        (path / name).is_file() for name in (HF_INDEX_FILENAME, HF_SINGLE_FILENAME)
    )


def is_full_checkpoint(location: Location) -> bool:
    """True for a local torch.save or safetensors file, or a Hugging Face folder (not a DCP folder)."""
    return isinstance(location, Path) and (location.is_file() or is_hf_folder(location))


def _short(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def open_full_file(path: Path) -> FullFile:
    """Open a full checkpoint by what the path holds.

    A Hugging Face folder (see ``is_hf_folder``), with its ``optimizer.pt`` and
    ``extra_state.pt``; ``.pt``/``.pth``/``.bin`` is torch.save; ``.safetensors`` one safetensors file.

    Raises:
        NotADcpCheckpointError: an unknown file type.
        CorruptChunkError: an unreadable file.
        UnsafeContentError: a pickle that would run code.
        CheckpointNotFoundError: a shard named by a folder's index is missing.
    """
    if path.is_dir():
        folder = SafetensorsFiles.from_folder(path)
        folder.add_side_files()
        return folder
    suffix = path.suffix.lower()
    if suffix in TORCH_SAVE_SUFFIXES:
        return TorchSaveFile(path)
    if suffix in SAFETENSORS_SUFFIXES:
        try:
            return SafetensorsFiles.from_file(path)
        except Exception as e:
            raise CorruptChunkError(f"{path}: not a readable safetensors file ({_short(e)})") from e
    raise NotADcpCheckpointError(f"{path}: unknown checkpoint file type {path.suffix!r}")


class FileBoxReader:
    """Boxes of the tensors of a full (unsharded) checkpoint, for ``reshard``.

    Reads a torch.save file (``weights_only=True, mmap=True``), a safetensors file or a Hugging
    Face folder; each box is a copy of a slice of the memory-mapped tensor.

    Its index (``file_index``) has one whole-tensor chunk per tensor and no data files, so a
    chunk, a full tensor and a box are all slices of the one stored tensor.

    Args:
        path: the source.
        check_crc: unused (nothing here stores CRC-32s); kept for the shared ``Reader`` signature.

    Raises:
        As ``open_full_file``.
    """

    def __init__(self, path: str | os.PathLike[str] | Location, *, check_crc: bool = True) -> None:
        self._source = open_full_file(Path(path))

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

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> None:
        """None: a full file's tensors are read through its memory map (``read_chunk``)."""
        return None

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor of ``entry``, shape ``entry.shape``, as a new contiguous tensor.

        Warning:
            Holds the full tensor (``entry.nbytes`` bytes) in memory.
        """
        return self.read_box(entry, (0,) * len(entry.shape), entry.shape)

    def read_box(self, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` (elements) of the tensor, as a new contiguous tensor."""
        tensor: torch.Tensor = self._source.get(self._key(entry.fqn))
        for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
            tensor = tensor.narrow(dim, o, n)
        return tensor.contiguous().clone()

    def _key(self, fqn: str) -> str:
        # safetensors sources name their keys model.<name>; file_index drops that level
        return MODEL_PREFIX + fqn if self._source.model_only else fqn

    def read_value(self, entry: BytesEntry) -> Any:
        """A plain value of the file (param group field, train state)."""
        return self._source.get(self._key(entry.fqn))

    def read_raw(self, entry: BytesEntry) -> bytes:
        """The value as DCP stores a bytes entry: its torch.save payload."""
        buf = io.BytesIO()
        torch.save(self.read_value(entry), buf)
        return buf.getvalue()


def file_index(path: str | os.PathLike[str]) -> CheckpointIndex:
    """An index for a full checkpoint file: one whole-tensor chunk per tensor, in the file's order.

    Keys and paths follow DCP's flattening; safetensors names stand alone (no ``model.`` level),
    as ``model.state_dict()`` has them. The index has no data files (world size 0).

    Raises:
        As ``open_full_file``.
    """
    p = Path(path)
    source = open_full_file(p)
    # (fqn, path, (dtype, shape)) for a tensor, (fqn, path, None) for a plain value
    items: list[tuple[str, ObjPath, tuple[torch.dtype, tuple[int, ...]] | None]] = []
    try:
        if isinstance(source, TorchSaveFile):
            for key, (obj_path, value) in source.flat_with_paths.items():
                described = (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else None
                items.append((key, obj_path, described))
        else:
            for key in source.keys():
                name = key.removeprefix(MODEL_PREFIX)
                items.append((name, (name,), source.describe(key)))  # from the header: no data read
    finally:
        source.close()
    entries: list[Entry] = []
    for key, obj_path, described in items:
        if described is None:
            entries.append(BytesEntry(fqn=key, path=obj_path, relative_path="", offset_bytes=0, length_bytes=0))
            continue
        dtype, shape = described
        whole = ChunkEntry(offsets=(0,) * len(shape), sizes=shape, relative_path=None, offset_bytes=0, length_bytes=0)
        entries.append(TensorEntry(fqn=key, path=obj_path, shape=shape, dtype=dtype, chunks=(whole,)))
    return CheckpointIndex(checkpoint_id=p, entries=tuple(entries), data_files=())
