"""Output kinds, one file: ``TorchSaveFile`` and ``SafetensorsFile`` (a file output, and the files of a folder)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.item import OutputItem
from fsdp_convert.output_table import SAFETENSORS_ROW, TORCH_SAVE_ROW, check_only
from fsdp_convert.outputs.kind import CrcOf, FileKind, FilePlan, Only, RowKind, ValueOf, value_tensor
from fsdp_convert.roles import GROUPS, Group
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers.hf_assets import HfAssets
from fsdp_convert.writers.safetensors import safetensors_placement, write_safetensors_header
from fsdp_convert.writers.torch_save import TensorSlot, torch_save_offsets, write_torch_save_headers

__all__ = ["RECORD_TAIL_BYTES", "TorchSaveFile", "SafetensorsFile", "check_tensors"]

RECORD_TAIL_BYTES = 256  # per torch.save item, past its storage: its data.pkl share, zip headers, central directory


def _whole_file(kind: FileKind, items: Sequence[OutputItem]) -> tuple[FilePlan, ...]:
    return (kind.place(items, tuple(range(len(items))), None, 0),)


def check_tensors(items: Sequence[OutputItem]) -> None:
    """Refuse a model value where safetensors holds tensors only.

    Raises:
        InvalidOptionError: naming the first model entry that is not a tensor.
    """
    for item in items:
        if item.group == "model" and not item.is_tensor:
            raise InvalidOptionError(f"{item.entry.fqn} is not a tensor; safetensors holds tensors only (use a .pt output)")


@dataclass(frozen=True, slots=True)
class _SingleFile(RowKind):
    """What a one-file output shares: no index, nothing beside it."""

    def shards(self, files: Sequence[FilePlan]) -> tuple[FilePlan, ...]:
        """None: one file has no index."""
        return ()

    def write_index(self, folder: Path, files: Sequence[FilePlan], items: Sequence[OutputItem]) -> int:
        """Nothing: one file has no index."""
        return 0

    def finish(
        self,
        folder: Path,
        *,
        index: CheckpointIndex,
        items: Sequence[OutputItem],
        options: TransformOptions,
        assets: HfAssets | None,
    ) -> int:
        """Nothing: a file output has nothing beside it (``--hf-assets`` asks for a folder)."""
        return 0


@dataclass(frozen=True, slots=True)
class TorchSaveFile(_SingleFile):
    """One torch.save file of the nested state dict (also a folder's ``optimizer.pt`` and ``extra_state.pt``).

    Storage records first, each at an offset known from the dtypes and shapes
    (``writers.torch_save.torch_save_offsets``); rank 0 writes ``data.pkl`` and the zip's headers
    last, with the CRC-32s the workers' bytes have.
    """

    row = TORCH_SAVE_ROW

    def groups(self, only: Only) -> tuple[Group, ...]:
        """Every group, or the one ``--only`` names."""
        return GROUPS if only == "all" else (only,)

    def plan_files(self, items: Sequence[OutputItem], *, max_shard_bytes: int) -> tuple[FilePlan, ...]:
        """The output itself, holding every item."""
        return _whole_file(self, items)

    def place(self, items: Sequence[OutputItem], ids: tuple[int, ...], filename: str | None, strip: int) -> FilePlan:
        """Storage offsets of the file's tensors, a ``value_tensor`` too (torch.save holds any value as well)."""
        return FilePlan(
            filename=filename, item_ids=ids, strip=strip, kind=self, data_offsets=torch_save_offsets(_slots(items, ids))
        )

    def size_bytes(self, file: FilePlan, items: Sequence[OutputItem]) -> int:
        """Storages, then ``data.pkl`` (each value at most its payload size) and the central directory, per item."""
        return file.data_end(items) + sum(
            RECORD_TAIL_BYTES + (0 if items[i].is_tensor else items[i].nbytes) for i in file.item_ids
        )

    def finish_file(self, fd: int, file: FilePlan, items: Sequence[OutputItem], crc_of: CrcOf, value_of: ValueOf) -> None:
        """The pickle of the nested state dict and the zip's headers, the storages' CRC-32s patched in.

        A ``value_tensor``'s storage is written here, by rank 0 (``write_torch_save_headers``).
        """
        contents: list[tuple[tuple[str | int, ...], Any]] = []
        crcs: dict[int, int] = {}
        for j, (i, offset) in enumerate(zip(file.item_ids, file.data_offsets, strict=True)):
            item = items[i]
            path = item.path[file.strip :]
            if item.is_tensor:
                assert item.dtype is not None and offset is not None
                crcs[j] = crc_of(offset, item.nbytes)
                contents.append((path, TensorSlot(item.dtype, item.shape)))
            else:
                contents.append((path, value_of(item)))  # a value_tensor: the tensor, its bytes written with the headers
        write_torch_save_headers(fd, contents, crcs, file.data_offsets)


def _slots(items: Sequence[OutputItem], ids: tuple[int, ...]) -> list[TensorSlot | None]:
    """Each item's storage: a tensor's, a ``value_tensor``'s, or None for a plain value."""
    slots: list[TensorSlot | None] = []
    for i in ids:
        item, tensor = items[i], value_tensor(items[i])
        if item.is_tensor and item.dtype is not None:
            slots.append(TensorSlot(item.dtype, item.shape))
        else:
            slots.append(None if tensor is None else TensorSlot(tensor.dtype, tuple(tensor.shape)))
    return slots


@dataclass(frozen=True, slots=True)
class SafetensorsFile(_SingleFile):
    """One safetensors file of the model weights (also each shard of a Hugging Face folder).

    Its header is known from the names, dtypes and shapes (``writers.safetensors.safetensors_placement``).
    """

    row = SAFETENSORS_ROW

    def groups(self, only: Only) -> tuple[Group, ...]:
        """The model weights only.

        Raises:
            InvalidOptionError: ``--only optim`` (the row's ``optim_refusal``).
        """
        check_only(self.row, only)
        return ("model",)

    def plan_files(self, items: Sequence[OutputItem], *, max_shard_bytes: int) -> tuple[FilePlan, ...]:
        """The output itself, holding every weight."""
        check_tensors(items)
        return _whole_file(self, items)

    def place(self, items: Sequence[OutputItem], ids: tuple[int, ...], filename: str | None, strip: int) -> FilePlan:
        """The header and every tensor's byte range.

        Raises:
            InvalidOptionError: a dtype safetensors cannot hold, or two tensors of one name.
        """
        tensors = []
        for i in ids:
            dtype = items[i].dtype
            assert dtype is not None  # safetensors files hold tensors only (check_tensors)
            tensors.append((items[i].path[strip:], dtype, items[i].shape))
        try:
            placement = safetensors_placement(tensors)
        except ValueError as e:
            raise InvalidOptionError(f"{filename or 'the output'}: {e}") from e
        return FilePlan(
            filename=filename,
            item_ids=ids,
            strip=strip,
            kind=self,
            data_offsets=tuple[int | None, ...](placement.data_offsets),
            header=placement.header,
        )

    def size_bytes(self, file: FilePlan, items: Sequence[OutputItem]) -> int:
        """The header and the tensors (exact)."""
        return file.data_end(items)

    def finish_file(self, fd: int, file: FilePlan, items: Sequence[OutputItem], crc_of: CrcOf, value_of: ValueOf) -> None:
        """The header, computed in the plan."""
        write_safetensors_header(fd, file.header)
