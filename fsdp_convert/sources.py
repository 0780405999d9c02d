"""Read stage for any checkpoint format: flat keys and values loaded one at a time.

``verify`` compares checkpoints of different formats through this one interface. Keys are DCP's
flattened keys (``model.layers.0.attn.wq.weight``, ``optim.state.<fqn>.exp_avg``,
``optim.param_groups.0.lr``); a torch.save file is flattened by DCP's own rules
(``torch/distributed/checkpoint/_traverse.py``: dicts always, lists only when they hold tensors or
containers); safetensors names get the ``model.`` prefix. Nothing is loaded whole: DCP tensors
are assembled one at a time, torch.save files are memory-mapped, safetensors are read per tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from fsdp_convert.errors import CheckpointNotFoundError, CorruptChunkError, NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.metadata import METADATA_FILENAME, BytesEntry, Entry, read_index
from fsdp_convert.plan import HF_INDEX_FILENAME, HF_SINGLE_FILENAME, SAFETENSORS_SUFFIXES, TORCH_SAVE_SUFFIXES, check_coverage
from fsdp_convert.reader import ChunkReader, check_data_files

__all__ = ["Source", "open_source", "flatten_like_dcp"]

MODEL_PREFIX = "model."


class Source(Protocol):
    """A checkpoint seen as flat keys; values are loaded on demand, one at a time."""

    path: Path
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


def flatten_like_dcp(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a nested state dict into dotted keys exactly as DCP's ``flatten_state_dict`` does."""
    flat: dict[str, Any] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not terminal(v)) for v in value)

    def visit(path: tuple[str, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif terminal(value):
            flat[".".join(path)] = value
        else:
            for i, v in enumerate(value):
                visit((*path, str(i)), v)

    for key, value in obj.items():
        visit((str(key),), value)
    return flat


class _DcpSource:
    kind = "dcp"
    model_only = False

    def __init__(self, path: Path, check_crc: bool) -> None:
        self.path = path
        self.index = read_index(path)
        check_data_files(self.index)
        self._entries: dict[str, Entry] = {e.fqn: e for e in self.index.entries}
        self._reader = ChunkReader(path, check_crc=check_crc)

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, key: str) -> Any:
        entry = self._entries[key]
        if isinstance(entry, BytesEntry):
            return self._reader.read_value(entry)
        check_coverage(entry)
        return self._reader.read_tensor(entry)

    def close(self) -> None:
        self._reader.close()


class _TorchSaveSource:
    kind = "torch_save"
    model_only = False

    def __init__(self, path: Path) -> None:
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
        self._flat = flatten_like_dcp(obj)

    def keys(self) -> list[str]:
        return list(self._flat)

    def get(self, key: str) -> Any:
        return self._flat[key]

    def close(self) -> None:
        self._flat = {}


class _SafetensorsSource:
    model_only = True

    def __init__(self, path: Path, files: dict[str, Path], kind: str) -> None:
        self.path, self.kind = path, kind
        self._files = files  # tensor name -> file
        self._open: dict[Path, Any] = {}

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
        return [MODEL_PREFIX + n for n in self._files]

    def get(self, key: str) -> Any:
        name = key.removeprefix(MODEL_PREFIX)
        return self._handle(self._files[name]).get_tensor(name)

    def close(self) -> None:
        self._open.clear()


def open_source(path: str | os.PathLike[str], *, check_crc: bool = True) -> Source:
    """Open a checkpoint of any supported format by what the path holds.

    A folder with ``.metadata`` is DCP; a folder with ``model.safetensors.index.json`` or
    ``model.safetensors`` is a Hugging Face folder; ``.pt``/``.pth``/``.bin`` is torch.save
    (loaded with ``weights_only=True, mmap=True``); ``.safetensors`` is one safetensors file.

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotADcpCheckpointError: a folder with none of the above, or an unknown file type.
        UnsafeContentError: a pickle that would run code.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p} does not exist")
    if p.is_dir():
        if (p / METADATA_FILENAME).is_file():
            return _DcpSource(p, check_crc)
        if (p / HF_INDEX_FILENAME).is_file() or (p / HF_SINGLE_FILENAME).is_file():
            return _SafetensorsSource.from_folder(p)
        raise NotADcpCheckpointError(f"{p} holds neither {METADATA_FILENAME} nor {HF_INDEX_FILENAME}; not a checkpoint")
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
