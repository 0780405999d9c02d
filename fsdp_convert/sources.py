"""Read stage for any checkpoint format: flat keys and values loaded one at a time.

``verify`` compares checkpoints of different formats through this one interface. Keys are DCP's
flattened keys (``model.layers.0.attn.wq.weight``, ``optim.state.<fqn>.exp_avg``,
``optim.param_groups.0.lr``); a torch.save file is flattened by DCP's own rules
(``torch/distributed/checkpoint/_traverse.py``: dicts always, lists only when they hold tensors or
containers); safetensors names get the ``model.`` prefix. Nothing is loaded whole: DCP tensors
are assembled one at a time, torch.save files are memory-mapped, safetensors are read per tensor.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from fsdp_convert.errors import CheckpointNotFoundError, CorruptChunkError, NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.layout import GROUPS, Group, classify, dcp_key, detect_producer
from fsdp_convert.metadata import (
    METADATA_FILENAME,
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    TensorEntry,
    read_index,
)
from fsdp_convert.plan import (
    EXTRA_STATE_FILENAME,
    HF_INDEX_FILENAME,
    HF_SINGLE_FILENAME,
    OPTIMIZER_FILENAME,
    SAFETENSORS_SUFFIXES,
    TORCH_SAVE_SUFFIXES,
    check_coverage,
)
from fsdp_convert.reader import ChunkReader, check_data_files
from fsdp_convert.remote import Location, Url, is_url
from fsdp_convert.transform import OutputItem, TransformOptions, build_items, needs_group_values
from fsdp_convert.writers.safetensors import SAFETENSORS_TO_TORCH

__all__ = ["Source", "open_source", "flatten_with_paths", "FileBoxReader", "file_index", "prepare_items"]

MODEL_PREFIX = "model."


class Source(Protocol):
    """A checkpoint seen as flat keys; values are loaded on demand, one at a time."""

    @property
    def path(self) -> Location:
        """Where the checkpoint is."""
        ...

    kind: str  # "dcp", "torch_save", "safetensors" or "hf_dir"
    model_only: bool  # holds model weights only (the safetensors formats)

    def keys(self) -> list[str]:
        """Every flat key, in the checkpoint's order."""
        ...

    def get(self, key: str) -> Any:
        """The value of ``key``: a CPU tensor, or a plain Python value."""
        ...

    def close(self) -> None:
        """Release open files."""
        ...


def flatten_with_paths(obj: Mapping[str, Any]) -> dict[str, tuple[tuple[str | int, ...], Any]]:
    """Flatten a nested state dict as DCP's ``flatten_state_dict`` does: dotted key -> (path, value).

    The path is the value's place in the nested dict, as DCP records it in ``planner_data``.
    """
    flat: dict[str, tuple[tuple[str | int, ...], Any]] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not terminal(v)) for v in value)

    def visit(path: tuple[str | int, ...], value: Any) -> None:
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


class _DcpSource:
    """A DCP checkpoint seen through ``transform`` items.

    Keys are the nested layout's (wrapper names removed, ``optimizer`` as ``optim``, flattened
    optimizer state nested).
    """

    kind = "dcp"
    model_only = False

    def __init__(self, path: Location, check_crc: bool, options: TransformOptions | None) -> None:
        self.path = path
        self.index = read_index(path)
        check_data_files(self.index)
        # no options: the keys as saved (what torch's dcp_to_torch_save gives); else as consolidate writes them
        raw = TransformOptions(keep_wrapper_names=True)
        items = prepare_items(self.index, options or raw, GROUPS, check_crc=check_crc, keep_layout=options is None)
        self._items: dict[str, OutputItem] = {dcp_key(item.path): item for item in items}
        self._reader = ChunkReader(path, check_crc=check_crc)

    def keys(self) -> list[str]:
        return list(self._items)

    def get(self, key: str) -> Any:
        item = self._items[key]
        if item.constant:
            return item.value
        entry = item.entry
        if isinstance(entry, BytesEntry):
            return self._reader.read_value(entry)
        check_coverage(entry)
        tensor = self._reader.read_tensor(entry)
        return tensor if item.dtype in (None, tensor.dtype) else tensor.to(item.dtype)

    def close(self) -> None:
        self._reader.close()


class _TorchSaveSource:
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
        return list(self._flat)

    def get(self, key: str) -> Any:
        return self._flat[key]

    def close(self) -> None:
        self._flat = {}
        self.flat_with_paths = {}


class _SafetensorsSource:
    model_only = True

    def __init__(self, path: Path, files: dict[str, Path], kind: str) -> None:
        self.path, self.kind = path, kind
        self._files = files  # tensor name -> file
        self._open: dict[Path, Any] = {}
        self._sides: list[_TorchSaveSource] = []

    @classmethod
    def from_file(cls, path: Path) -> _SafetensorsSource:
        with safe_open(path, "pt") as f:
            names = list(f.keys())
        return cls(path, {n: path for n in names}, "safetensors")

    @classmethod
    def from_folder(cls, path: Path) -> _SafetensorsSource:
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
        return [MODEL_PREFIX + n for n in self._files] + [k for side in self._sides for k in side.keys()]

    def get(self, key: str) -> Any:
        for side in self._sides:
            if key in side._flat:
                return side.get(key)
        name = key.removeprefix(MODEL_PREFIX)
        return self._handle(self._files[name]).get_tensor(name)

    def add_side_files(self) -> None:
        """A Hugging Face folder's ``optimizer.pt`` (as ``optim``) and ``extra_state.pt``, if present."""
        for filename, prefix in ((OPTIMIZER_FILENAME, ("optim",)), (EXTRA_STATE_FILENAME, ())):
            if (self.path / filename).is_file():
                self._sides.append(_TorchSaveSource(self.path / filename, prefix))
        self.model_only = not self._sides

    def describe(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """Dtype and shape of ``key`` from the file header alone (no tensor data is read)."""
        name = key.removeprefix(MODEL_PREFIX)
        view = self._handle(self._files[name]).get_slice(name)
        return SAFETENSORS_TO_TORCH[view.get_dtype()], tuple(view.get_shape())

    def close(self) -> None:
        self._open.clear()
        for side in self._sides:
            side.close()


def open_source(path: str | os.PathLike[str], *, check_crc: bool = True, options: TransformOptions | None = None) -> Source:
    """Open a checkpoint of any supported format by what the path holds.

    A folder with ``.metadata`` is DCP; a folder with ``model.safetensors.index.json`` or
    ``model.safetensors`` is a Hugging Face folder; ``.pt``/``.pth``/``.bin`` is torch.save
    (loaded with ``weights_only=True, mmap=True``); ``.safetensors`` is one safetensors file.
    A DCP checkpoint's keys are as saved (as torch's ``dcp_to_torch_save`` gives them), or, with
    ``options``, those ``consolidate`` writes under them; a Hugging Face folder's
    ``optimizer.pt`` and ``extra_state.pt`` come in as ``optim.*`` and their own keys.

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotADcpCheckpointError: a folder with none of the above, or an unknown file type.
        UnsafeContentError: a pickle that would run code.
    """
    if is_url(path):  # a remote DCP checkpoint
        return _DcpSource(Url(str(path).rstrip("/")), check_crc, options)
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p} does not exist")
    if p.is_dir():
        if not (p / METADATA_FILENAME).is_file() and ((p / HF_INDEX_FILENAME).is_file() or (p / HF_SINGLE_FILENAME).is_file()):
            folder = _SafetensorsSource.from_folder(p)
            folder.add_side_files()
            return folder
        return _DcpSource(p, check_crc, options)  # read_index names what is wrong with any other folder
    suffix = p.suffix.lower()
    if suffix in TORCH_SAVE_SUFFIXES:
        return _TorchSaveSource(p)
    if suffix in SAFETENSORS_SUFFIXES:
        try:
            return _SafetensorsSource.from_file(p)
        except Exception as e:
            raise CorruptChunkError(f"{p}: not a readable safetensors file ({_short(e)})") from e
    raise NotADcpCheckpointError(f"{p}: unknown checkpoint file type {p.suffix!r}")


def _short(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class FileBoxReader:
    """Boxes of the tensors of a full (unsharded) checkpoint file, for ``reshard``.

    Reads a torch.save file (``weights_only=True, mmap=True``), a safetensors file or a Hugging
    Face folder; each box is a copy of a slice of the memory-mapped tensor.

    Args:
        path: the source.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._source = open_source(path)

    def __enter__(self) -> FileBoxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._source.close()

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
        As ``open_source``.
    """
    p = Path(path)
    source = open_source(p)
    # (fqn, path, (dtype, shape)) for a tensor, (fqn, path, None) for a plain value
    items: list[tuple[str, tuple[str | int, ...], tuple[torch.dtype, tuple[int, ...]] | None]] = []
    try:
        if isinstance(source, _TorchSaveSource):
            for key, (obj_path, value) in source.flat_with_paths.items():
                described = (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else None
                items.append((key, obj_path, described))
        else:
            assert isinstance(source, _SafetensorsSource)
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


def _value_reader(index: CheckpointIndex, check_crc: bool) -> ChunkReader | FileBoxReader:
    if index.data_files:
        return ChunkReader(index.checkpoint_id, check_crc=check_crc)
    return FileBoxReader(index.checkpoint_id)  # a full checkpoint file (file_index)


def prepare_items(
    index: CheckpointIndex,
    options: TransformOptions,
    groups: tuple[Group, ...],
    *,
    check_crc: bool = True,
    keep_layout: bool = False,
) -> tuple[OutputItem, ...]:
    """Classify the entries, read the small param group values the transform needs, build the items.

    Args:
        index: the checkpoint (any source: DCP, rank files, safetensors shards, a full file).
        options: the transforms.
        groups: which groups to produce (``plan.groups_for``).
        check_crc: check CRC-32s of the param group payloads read.
        keep_layout: keep the producer's nesting (``reshard``; see ``transform.build_items``).

    Raises:
        As ``transform.build_items``, and the read errors of ``ChunkReader.read_value``.
    """
    slots = classify(index)
    wanted = needs_group_values(slots) if "optim" in groups else []
    values: dict[int, Any] = {}
    if wanted:
        with _value_reader(index, check_crc) as reader:
            for i in wanted:
                entry = index.entries[i]
                assert isinstance(entry, BytesEntry)
                values[i] = reader.read_value(entry)
    return build_items(
        index,
        slots,
        options,
        values,
        groups=groups,
        keep_layout=keep_layout,
        params_in_model_order=detect_producer(index) in ("fsdp1", "fsdp"),
    )
