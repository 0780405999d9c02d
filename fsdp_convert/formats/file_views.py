"""Read stage for full (unsharded) checkpoints, their files as flat views: torch.save and safetensors files.

A torch.save file, or a safetensors file or a folder's weights, as flat keys following DCP's
flattening (``formats.index.flatten_with_paths``); ``formats.full_file`` opens them by what a
path holds and indexes and reads them. Safetensors names get a ``model.`` prefix in the flat
view (``SafetensorsView``); a folder's torch.save files (``optimizer.pt``, ``extra_state.pt``)
come in nested under the paths the outputs table gives them (``output_table.folder_files``).
Nothing is loaded whole: torch.save files are memory-mapped, safetensors read per tensor. A
torch.save zip is first read without torch (``TorchSaveRecords``: its pickle as records of where
each tensor's bytes lie, ``formats._pt_records``), and memory-mapped by torch only where a
tensor is read as a tensor, or where those records do not cover the file.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_convert.constants import torch_shape
from fsdp_convert.dtypes import ITEMSIZES, DType, as_dtype, is_tensor, safetensors_dtype
from fsdp_convert.errors import CheckpointError, CheckpointNotFoundError, CorruptChunkError, NotADcpCheckpointError
from fsdp_convert.formats._pt_records import StoredTensor, load_records
from fsdp_convert.formats.file_reads import library_problem, load_torch_save, read_json_file, read_safetensors_header
from fsdp_convert.formats.index import ObjPath, ValueShapeError, flatten_with_paths, holds
from fsdp_convert.held_roots import open_inside
from fsdp_convert.location import safe_open_inside
from fsdp_convert.output_table import folder_files

__all__ = ["MODEL_PREFIX", "TorchSaveView", "TorchSaveRecords", "SafetensorsView", "FullFileView"]

MODEL_PREFIX = "model."
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


class TorchSaveView:
    """A torch.save file as flat keys, loaded by ``file_reads.load_torch_save`` (``weights_only=True``, memory-mapped).

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


class TorchSaveRecords:
    """A torch.save zip as flat keys without torch: its tensors ``StoredTensor`` records, its plain values as loaded.

    ``data.pkl`` is read by ``_pt_records.load_records``; the keys, paths and plain values are
    ``TorchSaveView``'s of the same file. ``located`` says where a contiguous tensor's bytes lie,
    to read them undecoded; a tensor's value (``get``) comes from a ``TorchSaveView`` of the file,
    loaded (and torch imported) at the first such call. Close it (it holds the file open).

    Args:
        path: the file.
        fd: its open descriptor (this view owns it).
        flat_with_paths: flat key -> (path, value), tensors as ``StoredTensor``.
    """

    kind = "torch_save"
    model_only = False

    def __init__(self, path: Path, fd: int, flat_with_paths: dict[str, tuple[ObjPath, Any]]) -> None:
        self.path, self.fd = path, fd
        self.flat_with_paths = flat_with_paths
        self._loaded: TorchSaveView | None = None

    @classmethod
    def open(cls, path: Path) -> TorchSaveRecords | None:
        """The view of ``path`` (a file the user named), or None where ``TorchSaveView`` must load it.

        None for all ``_pt_records.load_records`` leaves to torch's loader, for a pickle that is
        no state dict or does not flatten, and for a tensor inside a plain value (``TorchSaveView``
        reads, or names, each of these); and where the file cannot be opened (it names why).
        """
        try:
            fd = open_inside(path, path)
        except (OSError, CheckpointError):
            return None
        try:
            flat = _flat_records(load_records(fd, os.fstat(fd).st_size))
        except BaseException:
            os.close(fd)
            raise
        if flat is None:
            os.close(fd)
            return None
        return cls(path, fd, flat)

    def keys(self) -> list[str]:
        """Every flat key, in the file's order."""
        return list(self.flat_with_paths)

    def __contains__(self, key: str) -> bool:
        return key in self.flat_with_paths

    def stored(self, key: str) -> Any:
        """The value of ``key`` as recorded: a ``StoredTensor``, or a plain value.

        Raises:
            CorruptChunkError: no such key (the file changed since it was indexed).
        """
        if key not in self.flat_with_paths:
            raise CorruptChunkError(f"{self.path}: {key} is not in the file; did it change while it was read?")
        return self.flat_with_paths[key][1]

    def get(self, key: str) -> Any:
        """The value of ``key``: a plain value, or a tensor (memory-mapped by ``TorchSaveView``; imports torch).

        Raises:
            CorruptChunkError: no such key (the file changed since it was indexed).
            As ``TorchSaveView``.
        """
        value = self.stored(key)
        if not isinstance(value, StoredTensor):
            return value
        if self._loaded is None:
            self._loaded = TorchSaveView(self.path)
        return self._loaded.get(key)

    def located(self, key: str) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of ``key``'s tensor's elements in the file, in C order; None when not so stored.

        Raises:
            CorruptChunkError: no such key.
        """
        value = self.stored(key)
        return value.byte_range() if isinstance(value, StoredTensor) else None

    def close(self) -> None:
        """Close the file, and the loaded view if any."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._loaded is not None:
            self._loaded.close()
        self.flat_with_paths = {}


def _flat_records(obj: Any) -> dict[str, tuple[ObjPath, Any]] | None:
    """``obj`` (``load_records``') flattened as ``TorchSaveView`` flattens; None where that view must decide.

    None for no object, one that is no mapping, one that does not flatten, or a tensor record
    inside a plain value (a list or tuple of tensors: ``flatten_with_paths`` walks a list of
    tensors only when they are torch's).
    """
    if not isinstance(obj, Mapping):
        return None
    try:
        flat = flatten_with_paths(obj)
    except ValueError:  # ValueShapeError too: TorchSaveView names it
        return None
    for _, value in flat.values():
        if not isinstance(value, StoredTensor) and holds(value, lambda v: isinstance(v, StoredTensor)):
            return None
    return flat


class SafetensorsView:
    """A safetensors file, or a Hugging Face or PEFT folder's weights, as flat ``model.<name>`` keys.

    Tensors come in file order (shards by name, each by data offset), as this tool wrote them. A
    folder's torch.save files (``optimizer.pt``, ``extra_state.pt``) come in through ``add_side_files``.

    Args:
        path: the file or folder.
        tensors: tensor name -> (the file holding it, dtype, torch shape in elements), in order.
        kind: ``safetensors`` (a file) or ``hf_dir`` (a folder).
    """

    model_only = True

    def __init__(
        self,
        path: Path,
        tensors: dict[str, tuple[Path, DType, tuple[int, ...]]],
        kind: str,
        ranges: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        self.path, self.kind = path, kind
        self._tensors = tensors
        self._ranges = ranges or {}  # tensor name -> (offset, nbytes) of its elements in its file
        self._open: dict[Path, Any] = {}
        self._fds: dict[Path, int] = {}
        self.sides: list[TorchSaveView] = []

    @classmethod
    def from_files(
        cls, path: Path, files: Sequence[Path], kind: str, weight_map: Mapping[str, Path] | None = None
    ) -> SafetensorsView:
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
        ranges: dict[str, tuple[int, int]] = {}
        for file in files:
            header, data_start = read_safetensors_header(file, root=path)  # first: where the file lies, its header's size
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
                begin, end = desc["data_offsets"]
                if type(begin) is int and type(end) is int and end - begin == math.prod(shape) * dtype.itemsize:
                    ranges[name] = (data_start + begin, end - begin)  # safetensors checked the header against the file
        return cls(path, tensors, kind, ranges)

    @classmethod
    def from_folder(cls, path: Path) -> SafetensorsView:
        """A folder's weights: its index's shards, one weights file, or none (``output_table.folder_files``).

        An index (``model.safetensors.index.json``)'s ``weight_map`` names the shards; else the
        first weights file there (``model.safetensors``, PEFT's ``adapter_model.safetensors``);
        else no tensors (a folder of ``optimizer.pt`` alone).

        Raises:
            NotADcpCheckpointError: an index without a ``weight_map`` of file names, or naming a
                tensor its shard does not hold.
            CheckpointNotFoundError: a shard the index names is missing (or outside the folder).
            As ``from_files``.
        """
        index_path = next((path / f.name for f in folder_files("safetensors_index") if (path / f.name).is_file()), None)
        if index_path is None:
            weights = next((path / f.name for f in folder_files("safetensors") if (path / f.name).is_file()), None)
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
        """A folder's torch.save files, each nested under its path (``output_table.folder_files``).

        ``optimizer.pt`` nests under ``optimizer_key`` (it holds the state dict, not its key),
        ``extra_state.pt``'s keys are top-level.

        Raises:
            NotADcpCheckpointError: two of the folder's files hold the same top-level key.
            As ``TorchSaveView``.
        """
        tops: set[str | int] = {"model"} if self._tensors else set()
        for side_file in folder_files("torch_save"):
            if not (self.path / side_file.name).is_file():
                continue
            nest = (optimizer_key, *side_file.nest[1:]) if side_file.group == "optim" else side_file.nest
            self.sides.append(side := TorchSaveView(self.path / side_file.name, nest, root=self.path))
            own = {obj_path[0] for obj_path, _ in side.flat_with_paths.values()}
            if clash := own & tops:
                raise NotADcpCheckpointError(f"{side.path} holds {clash.pop()!r}, as another file of the folder does")
            tops |= own
        self.model_only = not self.sides

    def located(self, key: str) -> tuple[int, int, int, Path] | None:
        """``(fd, offset, nbytes, file)`` of ``key``'s tensor elements as they lie (C order, little-endian).

        The tensor ``get`` would read; None for a key of a side file, or one whose bytes are not known.

        Raises:
            UnsafeContentError: the file is a symbolic link out of the folder. OSError: it cannot be opened.
        """
        if any(key in side for side in self.sides):
            return None
        name = key.removeprefix(MODEL_PREFIX)
        found, where = self._tensors.get(name), self._ranges.get(name)
        if found is None or where is None or sys.byteorder != "little":
            return None
        file = found[0]
        if file not in self._fds:
            self._fds[file] = open_inside(self.path if self.path.is_dir() else file, file)
        return self._fds[file], where[0], where[1], file

    def close(self) -> None:
        """Close every open file."""
        self._open.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for side in self.sides:
            side.close()


FullFileView = TorchSaveView | TorchSaveRecords | SafetensorsView
