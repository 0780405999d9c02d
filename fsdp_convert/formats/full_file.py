"""Read stage for full (unsharded) checkpoints: a torch.save or safetensors file, a Hugging Face or PEFT folder.

Every output of ``consolidate`` is one; each is indexed as one whole-tensor chunk per tensor
(``file_index``) and read through ``FileBoxReader``, which slices the stored tensor. Keys follow
DCP's flattening (``formats.index.flatten_with_paths``). Safetensors names get a ``model.`` prefix
in the flat view (``SafetensorsFiles``), which ``file_index`` drops for weights alone (as
``model.state_dict()`` has them) and keeps beside a folder's ``optimizer.pt``. Nothing is loaded
whole: torch.save files are memory-mapped, safetensors read per tensor. A file's format comes
from its first bytes (``reader.sniff_file``), so a torch.save file under any name (``.ckpt``) is read.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_convert.constants import (
    ADAPTER_WEIGHTS_FILENAME,
    EXTRA_STATE_FILENAME,
    HF_INDEX_FILENAME,
    HF_SINGLE_FILENAME,
    METADATA_FILENAME,
    OPTIMIZER_FILENAME,
    SAFETENSORS_SUFFIXES,
    TORCH_SAVE_SUFFIXES,
    torch_shape,
)
from fsdp_convert.dtypes import ITEMSIZES, DType, as_dtype, is_tensor, safetensors_dtype
from fsdp_convert.errors import CheckpointNotFoundError, CorruptChunkError, NotADcpCheckpointError
from fsdp_convert.formats.index import (
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    Location,
    ObjPath,
    TensorEntry,
    ValueShapeError,
    flatten_with_paths,
    holds,
)
from fsdp_convert.formats.reader import library_problem, load_torch_save, read_json_file, read_safetensors_header, sniff_file
from fsdp_convert.location import safe_open_inside

if TYPE_CHECKING:
    import torch
__all__ = [
    "MODEL_PREFIX",
    "ADAPTER_WEIGHTS_FILENAME",
    "TorchSaveFile",
    "SafetensorsFiles",
    "FullFile",
    "flatten_with_paths",  # from formats.index
    "is_hf_folder",
    "is_full_checkpoint",
    "open_full_file",
    "FileBoxReader",
    "file_index",
]

MODEL_PREFIX = "model."
# a folder's files beside its safetensors, and the path each one's dict is nested under
SIDE_FILES: tuple[tuple[str, tuple[str, ...]], ...] = ((OPTIMIZER_FILENAME, ("optim",)), (EXTRA_STATE_FILENAME, ()))
_FOLDER_FILES = (HF_INDEX_FILENAME, HF_SINGLE_FILENAME, ADAPTER_WEIGHTS_FILENAME, OPTIMIZER_FILENAME, EXTRA_STATE_FILENAME)
_MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json: a weight_map of a few MB for the largest models


def _unreadable(value: Any) -> str | None:
    """Why a loaded value cannot be indexed, or None (a tensor in a plain value is written as torch.save does)."""
    if is_tensor(value):
        return None if _writable(value) else f"is a {value.dtype} {value.layout} tensor on {value.device}"
    inner = holds(value, lambda v: is_tensor(v) and not _writable(v))
    return f"holds a tensor inside a {type(value).__name__} that this tool cannot write" if inner else None


def _writable(tensor: Any) -> bool:
    """A dense CPU tensor of a dtype this tool handles."""
    return str(tensor.layout) == "torch.strided" and tensor.device.type == "cpu" and as_dtype(tensor.dtype).name in ITEMSIZES


class TorchSaveFile:
    """A torch.save file as flat keys, loaded by ``reader.load_torch_save`` (``weights_only=True``, memory-mapped).

    Args:
        path: the file.
        prefix: path elements to nest the loaded dict under (``("optim",)`` for an HF folder's
            ``optimizer.pt``, which holds the optimizer state dict itself).
        root: the folder it is part of (a link out of it is refused); None: ``path`` is what the user named.

    Raises:
        UnsafeContentError: a pickle that would run code, or a symbolic link out of ``root``.
        CorruptChunkError: not a readable torch.save file, or a value nested too deep or holding itself.
        NotADcpCheckpointError: it holds something other than a dict, a key that is neither a
            string nor an integer, two keys that flatten alike, or a tensor this tool cannot read
            (sparse, quantized, not on the CPU).
    """

    kind = "torch_save"
    model_only = False

    def __init__(self, path: Path, prefix: tuple[str, ...] = (), *, root: Path | None = None) -> None:
        self.path = path
        obj = load_torch_save(path, root=root)
        if not isinstance(obj, Mapping):
            raise NotADcpCheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict")
        for top in reversed(prefix):  # optimizer.pt holds the optimizer state dict itself
            obj = {top: obj}
        try:
            self.flat_with_paths = flatten_with_paths(obj)
        except ValueShapeError as e:  # exit 1: a checkpoint's file, with a value this tool does not hold
            raise CorruptChunkError(f"{path}: {e}; this tool does not read it") from e
        except ValueError as e:
            raise NotADcpCheckpointError(f"{path}: {e}") from e
        for key, (_, value) in self.flat_with_paths.items():
            if (why := _unreadable(value)) is not None:
                raise NotADcpCheckpointError(f"{path}: {key} {why}, which this tool does not read")
        self._flat = {key: value for key, (_, value) in self.flat_with_paths.items()}

    def keys(self) -> list[str]:
        """Every flat key, in the file's order."""
        return list(self._flat)

    def __contains__(self, key: str) -> bool:
        return key in self._flat

    def get(self, key: str) -> Any:
        """The value of ``key``: a memory-mapped CPU tensor or a plain value.

        Raises:
            CorruptChunkError: no such key (the file changed since it was indexed).
        """
        if key not in self._flat:
            raise CorruptChunkError(f"{self.path}: {key} is not in the file; did it change while it was read?")
        return self._flat[key]

    def close(self) -> None:
        """Drop the references to the memory map."""
        self._flat = {}
        self.flat_with_paths = {}


class SafetensorsFiles:
    """A safetensors file, or a Hugging Face or PEFT folder's weights, as flat ``model.<name>`` keys.

    Tensors come in file order (shards by name, each by data offset), as this tool wrote them. A
    folder's ``optimizer.pt`` and ``extra_state.pt`` come in through ``add_side_files``.

    Args:
        path: the file or folder.
        tensors: tensor name -> (the file holding it, dtype, torch shape in elements), in order.
        kind: ``safetensors`` (a file) or ``hf_dir`` (a folder).
    """

    model_only = True

    def __init__(self, path: Path, tensors: dict[str, tuple[Path, DType, tuple[int, ...]]], kind: str) -> None:
        self.path, self.kind = path, kind
        self._tensors = tensors
        self._open: dict[Path, Any] = {}
        self.sides: list[TorchSaveFile] = []

    @classmethod
    def from_files(
        cls, path: Path, files: Sequence[Path], kind: str, weight_map: Mapping[str, Path] | None = None
    ) -> SafetensorsFiles:
        """The tensors of ``files`` (their headers are read now), each file's by data offset.

        With ``weight_map`` (a folder's index: tensor name -> file), a file's other tensors are
        left out, as transformers leaves them.

        Raises:
            CorruptChunkError: a file safetensors cannot open, or a malformed header.
            NotADcpCheckpointError: a dtype this tool does not read, an ``F4`` shape that does not
                fill whole bytes, or a name two files hold.
            UnsafeContentError: a file of a folder is a symbolic link out of it (``location.inside``).
        """
        tensors: dict[str, tuple[Path, DType, tuple[int, ...]]] = {}
        for file in files:
            header, _ = read_safetensors_header(file, root=path)  # first: where the file lies, its header's size
            try:
                with safe_open_inside(path, file):
                    pass  # safetensors checks the header against the file
            except Exception as e:
                raise CorruptChunkError(f"{file}: not a readable safetensors file ({library_problem(e)})") from e
            header.pop("__metadata__", None)
            try:
                named = sorted(header.items(), key=lambda item: int(item[1]["data_offsets"][0]))
            except (KeyError, TypeError, ValueError, IndexError) as e:
                raise CorruptChunkError(f"{file}: malformed safetensors header ({type(e).__name__})") from e
            for name, desc in named:
                if weight_map is not None and weight_map.get(name) != file:
                    continue
                dtype = safetensors_dtype(str(desc.get("dtype")))
                try:
                    if dtype is None:
                        raise ValueError("a safetensors dtype this tool does not read")  # the name is the file's text: not quoted
                    shape = torch_shape(dtype, desc["shape"])
                except (ValueError, KeyError) as e:
                    raise NotADcpCheckpointError(f"{file}: {name}: {e}") from e
                if name in tensors:
                    raise NotADcpCheckpointError(f"{file}: {name} is also in {tensors[name][0].name}")
                tensors[name] = (file, dtype, shape)
        return cls(path, tensors, kind)

    @classmethod
    def from_folder(cls, path: Path) -> SafetensorsFiles:
        """A folder's weights: its index's shards, ``model.safetensors``, PEFT's adapter, or none.

        ``model.safetensors.index.json``'s ``weight_map`` names the shards; else
        ``model.safetensors`` or ``adapter_model.safetensors``; else no tensors (a folder of
        ``optimizer.pt`` alone).

        Raises:
            NotADcpCheckpointError: an index without a ``weight_map`` of file names, or naming a
                tensor its shard does not hold.
            CheckpointNotFoundError: a shard the index names is missing (or outside the folder).
            As ``from_files``.
        """
        index_path = path / HF_INDEX_FILENAME
        if not index_path.is_file():
            weights = next((path / n for n in (HF_SINGLE_FILENAME, ADAPTER_WEIGHTS_FILENAME) if (path / n).is_file()), None)
            return cls.from_files(path, [weights] if weights else [], "hf_dir")
        index = read_json_file(path, index_path, _MAX_INDEX_BYTES)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise NotADcpCheckpointError(f"{index_path} has no weight_map of tensor names to file names")
        files = sorted({path / v for v in weight_map.values()})
        for f in files:
            if f.parent != path or not f.is_file():
                raise CheckpointNotFoundError(f"{f} (named in {index_path}) is missing")
        folder = cls.from_files(path, files, "hf_dir", {str(k): path / v for k, v in weight_map.items()})
        missing = next((str(k) for k in weight_map if str(k) not in folder._tensors), None)
        if missing is not None:
            raise NotADcpCheckpointError(f"{index_path} maps {missing} to {weight_map[missing]}, which does not hold it")
        return folder

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            self._open[file] = safe_open_inside(self.path, file)
        return self._open[file]

    def tensors(self) -> list[tuple[str, DType, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every tensor, in file order, from the headers alone (shapes in torch elements).

        The dtype comes from ``constants.SAFETENSORS_TO_TORCH``, the shape through
        ``constants.torch_shape`` (an ``F4`` header counts 4-bit values, two per element).
        """
        return [(name, dtype, shape) for name, (_, dtype, shape) in self._tensors.items()]

    def keys(self) -> list[str]:
        """Every flat key: ``model.<name>`` per tensor, then the side files' keys."""
        return [MODEL_PREFIX + n for n in self._tensors] + [k for side in self.sides for k in side.keys()]

    def get(self, key: str) -> Any:
        """The value of ``key``; a tensor is read from its file now (a new CPU tensor).

        Raises:
            CorruptChunkError: no such key, or the tensor cannot be read.
        """
        for side in self.sides:
            if key in side:
                return side.get(key)
        name = key.removeprefix(MODEL_PREFIX)
        if name not in self._tensors:
            raise CorruptChunkError(f"{self.path}: {key} is not in the checkpoint; did it change while it was read?")
        file = self._tensors[name][0]
        try:
            return self._handle(file).get_tensor(name)
        except Exception as e:
            raise CorruptChunkError(f"{file}: {name} cannot be read ({library_problem(e)})") from e

    def add_side_files(self, optimizer_key: str = "optim") -> None:
        """A folder's ``optimizer.pt`` (under ``optimizer_key``: it holds the state dict, not its key) and ``extra_state.pt``.

        Raises:
            NotADcpCheckpointError: two of the folder's files hold the same top-level key.
            As ``TorchSaveFile``.
        """
        tops: set[str | int] = {"model"} if self._tensors else set()
        for filename, prefix in ((f, (optimizer_key,) if f == OPTIMIZER_FILENAME else p) for f, p in SIDE_FILES):
            if not (self.path / filename).is_file():
                continue
            self.sides.append(side := TorchSaveFile(self.path / filename, prefix, root=self.path))
            own = {obj_path[0] for obj_path, _ in side.flat_with_paths.values()}
            if clash := own & tops:
                raise NotADcpCheckpointError(f"{side.path} holds {clash.pop()!r}, as another file of the folder does")
            tops |= own
        self.model_only = not self.sides

    def close(self) -> None:
        """Close every open file."""
        self._open.clear()
        for side in self.sides:
            side.close()


FullFile = TorchSaveFile | SafetensorsFiles


def is_hf_folder(path: Path) -> bool:
    """A folder with no ``.metadata`` that holds what ``consolidate`` writes to a folder.

    That is Hugging Face weights (``model.safetensors.index.json``, ``model.safetensors``), a PEFT
    adapter (``adapter_model.safetensors``), or an ``optimizer.pt`` or ``extra_state.pt``.
    """
    return not (path / METADATA_FILENAME).is_file() and any((path / name).is_file() for name in _FOLDER_FILES)


def is_full_checkpoint(location: Location) -> bool:
    """True for a local file, or a Hugging Face or PEFT folder (see ``is_hf_folder``; not a DCP folder)."""
    return isinstance(location, Path) and (location.is_file() or is_hf_folder(location))


def open_full_file(path: Path, *, optimizer_key: str = "optim") -> FullFile:
    """Open a full checkpoint by what the path holds.

    A folder (see ``is_hf_folder``), with ``optimizer.pt`` (under ``optimizer_key``) and ``extra_state.pt``;
    a file by its first bytes (``reader.sniff_file``: a torch.save zip or legacy pickle, or safetensors),
    whatever its name, else by its suffix: ``.pt``/``.pth``/``.bin`` torch.save, ``.safetensors``.

    Raises:
        NotADcpCheckpointError: an unknown file type, or a folder with none of those files.
        CorruptChunkError: an unreadable file.
        UnsafeContentError: a pickle that would run code.
        CheckpointNotFoundError: a shard named by a folder's index is missing.
    """
    if path.is_dir():
        folder = SafetensorsFiles.from_folder(path)
        folder.add_side_files(optimizer_key)
        if not folder.keys() and not folder.sides:
            raise NotADcpCheckpointError(f"{path}: no .metadata and no weights or {OPTIMIZER_FILENAME}; not a checkpoint")
        return folder
    suffix = path.suffix.lower()
    kind = sniff_file(path)
    if kind in ("torch_save", "legacy_torch_save") or (kind is None and suffix in TORCH_SAVE_SUFFIXES):
        return TorchSaveFile(path)
    if kind == "safetensors" or suffix in SAFETENSORS_SUFFIXES:
        return SafetensorsFiles.from_files(path, [path], "safetensors")
    raise NotADcpCheckpointError(f"{path}: unknown checkpoint file type {path.suffix!r} (not torch.save or safetensors)")


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
        """The box ``[offsets, offsets + sizes)`` (elements) of the tensor, as a new contiguous tensor.

        Raises:
            CorruptChunkError: the stored value is not the tensor the index describes (the file changed).
        """
        tensor = self._source.get(self._key(entry.fqn))
        if not is_tensor(tensor) or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise CorruptChunkError(f"{entry.fqn}: the stored value is not a {entry.dtype} {list(entry.shape)}; did it change?")
        for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
            tensor = tensor.narrow(dim, o, n)
        return tensor.contiguous().clone()

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
    has them; beside a folder's side files they go under ``model``, the optimizer under ``optim``,
    ``extra_state.pt``'s at the top: ``consolidate``'s nested layout (no data files: world size 0).

    Raises:
        As ``open_full_file``.
    """
    p = Path(path)
    source = open_full_file(p)
    entries: list[Entry] = []
    try:
        if isinstance(source, SafetensorsFiles):
            for name, dtype, shape in source.tensors():  # from the headers: no data read
                fqn, obj_path = (name, (name,)) if source.model_only else (MODEL_PREFIX + name, ("model", name))
                entries.append(_whole_tensor(fqn, obj_path, dtype, shape))
        for side in [source] if isinstance(source, TorchSaveFile) else source.sides:
            for key, (value_path, value) in side.flat_with_paths.items():
                if is_tensor(value):
                    entries.append(_whole_tensor(key, value_path, value.dtype, tuple(value.shape)))
                else:
                    entries.append(BytesEntry(fqn=key, path=value_path, relative_path="", offset_bytes=0, length_bytes=0))
    finally:
        source.close()
    return CheckpointIndex(checkpoint_id=p, entries=tuple(entries), data_files=())


def _whole_tensor(fqn: str, path: ObjPath, dtype: torch.dtype | DType, shape: tuple[int, ...]) -> TensorEntry:
    whole = ChunkEntry(offsets=(0,) * len(shape), sizes=shape, relative_path=None, offset_bytes=0, length_bytes=0)
    return TensorEntry(fqn=fqn, path=path, shape=shape, dtype=dtype, chunks=(whole,))
