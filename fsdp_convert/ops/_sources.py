"""Sides of ``verify``: a checkpoint of any format found once, then seen as flat keys whose values load one at a time.

A side is found once (``find_side``: its format decided and its index read by
``formats.open_checkpoint``'s table), and travels to verify's workers as is. Each process then
sees it as flat keys (``open_view``): a DCP checkpoint (or, seen through transforms, any
checkpoint) through ``transform`` items read with its ``Source``'s reader; torch.save files,
safetensors files and Hugging Face folders through ``formats.full_file``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fsdp_convert.dtypes import as_dtype
from fsdp_convert.errors import CheckpointNotFoundError
from fsdp_convert.formats import Source, source_format
from fsdp_convert.formats.full_file import open_full_file
from fsdp_convert.formats.index import BytesEntry, Location, TensorEntry, Url, check_coverage, dcp_key
from fsdp_convert.items import prepare_items
from fsdp_convert.remote import is_url
from fsdp_convert.roles import GROUPS
from fsdp_convert.transform import OutputItem, TransformOptions

__all__ = ["FlatView", "ItemsView", "Side", "find_side", "open_view", "open_source"]


class FlatView(Protocol):
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


@dataclass(frozen=True, slots=True)
class Side:
    """One side of ``verify``, found once; picklable (it travels to verify's workers).

    Attributes:
        path: the path as given (a ``Url`` for a remote checkpoint).
        source: its format and index, when it is read through ``transform`` items (any sharded
            checkpoint; a full file seen through transforms); None: a full file read whole
            (``formats.full_file.open_full_file``).
        optimizer_key: the top-level key a Hugging Face folder's ``optimizer.pt`` is read under
            (``optim``; ``verify`` sets the other side's, as ``optimizer.pt`` holds no key).
    """

    path: Location
    source: Source | None
    optimizer_key: str = "optim"


def find_side(path: str | os.PathLike[str] | Source, *, check_crc: bool = True, through_items: bool = False) -> Side:
    """Decide a side's format and read its index, once; its data files are checked to exist.

    Args:
        path: a DCP folder (local or fsspec URL), any other sharded checkpoint, a torch.save or
            safetensors file, or a Hugging Face or PEFT folder; or its ``Source``, already found
            (``consolidate``'s ``verify_output`` compares with its own input: not read again).
        check_crc: its readers check CRC-32s of DCP payloads.
        through_items: a full file too is read through ``transform`` items (its index read now).

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotADcpCheckpointError: a folder of no known format (named by DCP's reader), or a malformed index.
        UnsafeContentError: a pickle that would run code, or a file linked from outside the folder.
        MissingDataFileError: a data file the index names is missing.
    """
    if isinstance(path, Source):
        source: Source | None = dataclasses.replace(path, check_crc=check_crc)
        if path.format.full and not through_items:
            source = None  # a full file, read whole
        elif source is not None:
            source.check_data_files()
        return Side(path.checkpoint_id, source)
    if is_url(path):  # a remote DCP checkpoint
        root: Location = Url(str(path).rstrip("/"))
    else:
        root = Path(path)
        if not root.exists():
            raise CheckpointNotFoundError(f"{root} does not exist")
    fmt = source_format(root, full_files=True)
    if fmt.full and not through_items:
        return Side(root, None)
    source = fmt.open(root, check_crc=check_crc)  # a full file too, when it is seen through transforms
    source.check_data_files()
    return Side(root, source)


class ItemsView:
    """A checkpoint seen through ``transform`` items, read with its ``Source``'s reader.

    Keys are the nested layout's (wrapper names removed, ``optimizer`` as ``optim``, flattened
    optimizer state nested); with no transform, the keys as saved (what torch's
    ``dcp_to_torch_save`` gives).

    Args:
        side: the side (``side.source`` set).
        transform: the transforms; None: the keys as saved.
    """

    kind = "dcp"
    model_only = False

    def __init__(self, side: Side, transform: TransformOptions | None) -> None:
        assert side.source is not None  # find_side made it so
        self.path = side.path
        source = side.source
        # no transform: the keys as saved (what torch's dcp_to_torch_save gives); else as consolidate writes them
        raw = TransformOptions(keep_wrapper_names=True)
        items = prepare_items(source, transform or raw, GROUPS, keep_layout=transform is None)  # read with its reader
        self._items: dict[str, OutputItem] = {dcp_key(item.path): item for item in items}
        self._reader = source.open_reader()

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
        if item.dtype is None or item.dtype == as_dtype(tensor.dtype):
            return tensor
        # cast as consolidate's writers do, element by element (a 0-dim tensor would take torch's
        # scalar path); NaN bits still vary by torch's code path, so a cast key compares NaNs as NaNs
        return tensor.reshape(-1).to(item.dtype.torch).reshape(tensor.shape)

    def item(self, key: str) -> OutputItem:
        """``key``'s item: its group as classified (torchtitan's top-level weights are ``model``), its bytes as read."""
        return self._items[key]

    def was_cast(self, key: str) -> bool:
        """True when ``key``'s tensor is read in another dtype than stored (``--dtype``/``--optim-dtype``)."""
        item = self._items[key]
        return isinstance(item.entry, TensorEntry) and item.dtype not in (None, item.entry.dtype)

    def close(self) -> None:
        self._reader.close()


def open_view(side: Side, transform: TransformOptions | None) -> FlatView:
    """``side`` seen as flat keys: through ``transform`` items (``ItemsView``), or a full file read whole.

    Raises:
        As ``formats.full_file.open_full_file`` and ``items.prepare_items``.
    """
    if side.source is not None:
        return ItemsView(side, transform)
    assert isinstance(side.path, Path)  # find_side: a full file is local
    return open_full_file(side.path, optimizer_key=side.optimizer_key)


def open_source(
    path: str | os.PathLike[str],
    *,
    check_crc: bool = True,
    options: TransformOptions | None = None,
    transform_files: bool = False,
) -> FlatView:
    """Open a checkpoint of any supported format by what the path holds (``find_side`` then ``open_view``).

    A folder with ``.metadata`` is DCP; a folder with ``model.safetensors.index.json`` or
    ``model.safetensors`` is a Hugging Face folder; ``.pt``/``.pth``/``.bin`` is torch.save
    (loaded with ``weights_only=True, mmap=True``); ``.safetensors`` is one safetensors file.
    A DCP checkpoint's keys are as saved (as torch's ``dcp_to_torch_save`` gives them), or, with
    ``options``, those ``consolidate`` writes under them; a Hugging Face folder's
    ``optimizer.pt`` and ``extra_state.pt`` come in as ``optim.*`` and their own keys. With
    ``transform_files``, a full file is seen through ``options`` too (the source of a
    ``consolidate --verify`` whose input was a file).

    Raises:
        As ``find_side`` and ``open_view``.
    """
    side = find_side(path, check_crc=check_crc, through_items=transform_files and options is not None)
    return open_view(side, options)
