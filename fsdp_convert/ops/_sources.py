"""Sources of ``verify``: a checkpoint of any format seen as flat keys, its values loaded one at a time.

A DCP checkpoint (or, seen through transforms, any checkpoint) is read through ``transform``
items; torch.save files, safetensors files and Hugging Face folders through ``formats.full_file``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from fsdp_convert.errors import CheckpointNotFoundError
from fsdp_convert.formats import check_data_files, detect_format, open_reader, read_index
from fsdp_convert.formats.full_file import open_full_file
from fsdp_convert.formats.index import BytesEntry, Location, TensorEntry, Url, check_coverage, dcp_key
from fsdp_convert.items import prepare_items
from fsdp_convert.layout import GROUPS
from fsdp_convert.remote import is_url
from fsdp_convert.transform import OutputItem, TransformOptions

__all__ = ["Source", "DcpSource", "open_source"]


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


class DcpSource:
    """A DCP checkpoint seen through ``transform`` items.

    Keys are the nested layout's (wrapper names removed, ``optimizer`` as ``optim``, flattened
    optimizer state nested).
    """

    kind = "dcp"
    model_only = False

    def __init__(self, path: Location, check_crc: bool, options: TransformOptions | None) -> None:
        self.path = path
        self.index = read_index(path, full_files=True)  # a full file too, when it is seen through transforms
        check_data_files(self.index)
        # no options: the keys as saved (what torch's dcp_to_torch_save gives); else as consolidate writes them
        raw = TransformOptions(keep_wrapper_names=True)
        items = prepare_items(self.index, options or raw, GROUPS, check_crc=check_crc, keep_layout=options is None)
        self._items: dict[str, OutputItem] = {dcp_key(item.path): item for item in items}
        self._reader = open_reader(path, check_crc=check_crc)

    def keys(self) -> list[str]:
        return list(self._items)

    def get(self, key: str) -> Any:
        item = self._items[key]
        if item.constant:
            return item.value
        entry = item.entry
        if isinstance(entry, BytesEntry):
            return self._reader.read_value(entry)
        if item.derived is not None:  # an adapter's rows: recomputed from its whole inputs (derive.Derived.compute)
            for source in item.sources:
                check_coverage(source)
            tensor = item.derived.compute([self._reader.read_tensor(source) for source in item.sources])
        else:
            check_coverage(entry)
            tensor = self._reader.read_tensor(entry)
        if item.dtype in (None, tensor.dtype):
            return tensor
        # cast as consolidate's writers do, element by element (a 0-dim tensor would take torch's
        # scalar path); NaN bits still vary by torch's code path, so a cast key compares NaNs as NaNs
        return tensor.reshape(-1).to(item.dtype).reshape(tensor.shape)

    def item(self, key: str) -> OutputItem:
        """``key``'s item: its group as classified (torchtitan's top-level weights are ``model``), its bytes as read."""
        return self._items[key]

    def was_cast(self, key: str) -> bool:
        """True when ``key``'s tensor is read in another dtype than stored (``--dtype``/``--optim-dtype``)."""
        item = self._items[key]
        return isinstance(item.entry, TensorEntry) and item.dtype not in (None, item.entry.dtype)

    def close(self) -> None:
        self._reader.close()


def open_source(
    path: str | os.PathLike[str],
    *,
    check_crc: bool = True,
    options: TransformOptions | None = None,
    transform_files: bool = False,
) -> Source:
    """Open a checkpoint of any supported format by what the path holds.

    A folder with ``.metadata`` is DCP; a folder with ``model.safetensors.index.json`` or
    ``model.safetensors`` is a Hugging Face folder; ``.pt``/``.pth``/``.bin`` is torch.save
    (loaded with ``weights_only=True, mmap=True``); ``.safetensors`` is one safetensors file.
    A DCP checkpoint's keys are as saved (as torch's ``dcp_to_torch_save`` gives them), or, with
    ``options``, those ``consolidate`` writes under them; a Hugging Face folder's
    ``optimizer.pt`` and ``extra_state.pt`` come in as ``optim.*`` and their own keys. With
    ``transform_files``, a full file is seen through ``options`` too (the source of a
    ``consolidate --verify`` whose input was a file).

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotADcpCheckpointError: a folder with none of the above, or an unknown file type.
        UnsafeContentError: a pickle that would run code.
    """
    if is_url(path):  # a remote DCP checkpoint
        return DcpSource(Url(str(path).rstrip("/")), check_crc, options)
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p} does not exist")
    if detect_format(p, full_files=True) != "full_file":
        return DcpSource(p, check_crc, options)  # read_index names what is wrong with any other folder
    if transform_files and options is not None:
        return DcpSource(p, check_crc, options)
    return open_full_file(p)
