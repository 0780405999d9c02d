"""Output kinds, the protocols: ``Output`` and ``OutputKind`` (what ``consolidate`` writes), ``FileKind``, ``FilePlan``.

Each kind's class takes its name, folder flag and last files from its row of the outputs table
(``RowKind``, ``output_table.OutputRow``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from fsdp_convert.dtypes import is_tensor
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.item import OutputItem
from fsdp_convert.output_table import OutputRow, RequestedFormat  # RequestedFormat: re-exported
from fsdp_convert.roles import Group
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers.hf_assets import HfAssets

if TYPE_CHECKING:
    import torch

__all__ = [
    "Only",
    "RequestedFormat",
    "CrcOf",
    "ValueOf",
    "FilePlan",
    "FileKind",
    "RowKind",
    "Output",
    "OutputKind",
    "value_tensor",
    "stored_bytes",
]

Only = Literal["all", "model", "optim"]
CrcOf = Callable[[int, int], int]  # (offset, nbytes) in the file -> CRC-32 of those bytes, as the workers wrote them
ValueOf = Callable[[OutputItem], Any]  # a plain value item -> its value, read from the checkpoint


def value_tensor(item: OutputItem) -> torch.Tensor | None:
    """A constant item's tensor, or None: a small tensor of a merged file (``plan.items``: Megatron's 0-dim step).

    Rank 0 writes its bytes itself, as a storage record of its own, when it finishes the file
    (``FileKind.finish_file``); the workers move only the checkpoint's tensors.
    """
    return item.value if item.constant and is_tensor(item.value) else None


def stored_bytes(item: OutputItem) -> int:
    """Bytes of the item's storage in the file: a tensor's (``OutputItem.nbytes``), a ``value_tensor``'s, 0 for a value."""
    tensor = value_tensor(item)
    return item.nbytes if tensor is None else tensor.numel() * tensor.element_size()


@dataclass(frozen=True, slots=True, kw_only=True)
class FilePlan:
    """One output file, placed before any data is read: its items and where each tensor's bytes go.

    Attributes:
        filename: name inside the output folder, or None for the output path itself.
        item_ids: indices into ``WorkPlan.items``, in file order.
        strip: leading path elements dropped in the file (1 for ``optimizer.pt``, which holds the
            optimizer state dict itself, not ``{"optim": ...}``).
        kind: the file's format (``TorchSaveFile``, ``SafetensorsFile``): it finishes the file.
        data_offsets: per item of ``item_ids``, where its tensor's bytes start in the file, in
            bytes (None for a plain value; a torch.save file places a ``value_tensor``'s storage too).
        header: a safetensors file's header bytes (empty for torch.save, whose headers rank 0
            writes once the values are read).
    """

    filename: str | None
    item_ids: tuple[int, ...]
    strip: int
    kind: FileKind
    data_offsets: tuple[int | None, ...]
    header: bytes = b""

    @property
    def output_format(self) -> str:
        """The file's format name: ``torch_save`` or ``safetensors``."""
        return self.kind.name

    def data_end(self, items: Sequence[OutputItem]) -> int:
        """Where the last tensor's bytes end in the file (the header's end if it holds none), in bytes."""
        ends = [o + stored_bytes(items[i]) for i, o in zip(self.item_ids, self.data_offsets, strict=True) if o is not None]
        return max(ends, default=len(self.header))


class FileKind(Protocol):
    """One output file's format: how its tensors are placed, how big it gets, how rank 0 finishes it.

    Instances are picklable values (they travel to the workers in the plan).
    """

    @property
    def name(self) -> str:
        """The format's name (``torch_save``, ``safetensors``), as ``FilePlan.output_format`` reports it."""
        ...

    def place(self, items: Sequence[OutputItem], ids: tuple[int, ...], filename: str | None, strip: int) -> FilePlan:
        """Place one file of items ``ids`` (in file order): every tensor's byte offset, from shapes and dtypes alone.

        Raises:
            InvalidOptionError: an item the format cannot hold (the message names it).
        """
        ...

    def size_bytes(self, file: FilePlan, items: Sequence[OutputItem]) -> int:
        """The file's size, in bytes, from its placement: exact, or a few bytes per item high, never low."""
        ...

    def finish_file(self, fd: int, file: FilePlan, items: Sequence[OutputItem], crc_of: CrcOf, value_of: ValueOf) -> None:
        """Rank 0, once every worker's tensors are in place: write what is not tensor data (headers, pickle).

        Args:
            fd: the file, open for writing, its tensors' bytes in place.
            file: its plan.
            items: the plan's items (``file.item_ids`` index them).
            crc_of: the CRC-32 of a byte range of the file (a format that stores CRC-32s asks).
            value_of: a plain value item's value.
        """
        ...


class RowKind:
    """What a kind's class takes from its row of the outputs table (``row``): its name, folder flag, last files.

    A class sets ``row`` (``output_table.OutputRow``); ``outputs.output_kind`` finds the class of
    the row it chose in ``OUTPUT_KINDS`` by the row's name.
    """

    __slots__ = ()
    row: ClassVar[OutputRow]

    @property
    def name(self) -> str:
        """The result's ``output_format`` (``OutputRow.output_format``); a ``FilePlan``'s format for a file kind."""
        return self.row.output_format

    @property
    def directory(self) -> bool:
        """Whether OUT is a folder (``OutputRow.folder``)."""
        return self.row.folder

    @property
    def last(self) -> tuple[str, ...]:
        """Files written last (``OutputRow.last``)."""
        return self.row.last


class Output(Protocol):
    """What an operation writes, as its row says: ``OutputKind`` (``consolidate``) or ``outputs.DcpFolder`` (``reshard``).

    Instances are picklable values (they travel to the workers in the plan).
    """

    @property
    def row(self) -> OutputRow:
        """Its row of the outputs table (``output_table.OUTPUT_ROWS``)."""
        ...

    @property
    def name(self) -> str:
        """The result's ``output_format``: ``torch_save``, ``safetensors``, ``hf_dir`` or ``dcp``."""
        ...

    @property
    def directory(self) -> bool:
        """Whether OUT is a folder (its temporary, lock and space check are a folder's)."""
        ...

    @property
    def last(self) -> tuple[str, ...]:
        """Names of files in an output folder written last: uploaded after all others to a URL."""
        ...

    def groups(self, only: Only) -> tuple[Group, ...]:
        """The groups the output holds, for ``--only``.

        Raises:
            InvalidOptionError: a group this kind cannot hold (optimizer state in a safetensors file).
        """
        ...


class OutputKind(Output, Protocol):
    """What ``consolidate`` writes: chosen once (``output_kind``), carried by the plan, finished by rank 0.

    Instances are picklable values (they travel to the workers in the plan).
    """

    def plan_files(self, items: Sequence[OutputItem], *, max_shard_bytes: int) -> tuple[FilePlan, ...]:
        """Every output file, placed: their names, which items each holds, every tensor's byte offset.

        Args:
            items: what to write, restricted to ``groups(only)``.
            max_shard_bytes: the largest shard of a sharded folder, in bytes.

        Raises:
            InvalidOptionError: a value where only tensors go, or a tensor the format cannot hold.
        """
        ...

    def shards(self, files: Sequence[FilePlan]) -> tuple[FilePlan, ...]:
        """The files the folder's index lists (a Hugging Face folder's safetensors shards); none for a file."""
        ...

    def write_index(self, folder: Path, files: Sequence[FilePlan], items: Sequence[OutputItem]) -> int:
        """Rank 0, once every file is finished: write the folder's index, if it has one; its size in bytes (0: none).

        Raises:
            OSError: it cannot be written.
        """
        ...

    def finish(
        self,
        folder: Path,
        *,
        index: CheckpointIndex,
        items: Sequence[OutputItem],
        options: TransformOptions,
        assets: HfAssets | None,
    ) -> int:
        """The writing process, once the workers are done: write the files beside the weights; their bytes.

        Args:
            folder: the temporary output.
            index: the checkpoint read.
            items: the plan's items.
            options: the transforms applied (``--dtype`` names the config's dtype).
            assets: ``--hf-assets``, opened (only a folder output takes them).

        Raises:
            OutputWriteError: a file cannot be written.
        """
        ...
