"""Output kinds: what ``consolidate`` and ``reshard`` write, one class per row of the outputs table.

After torch DCP's ``StorageWriter`` (``HuggingFaceStorageWriter`` overrides ``write_data`` and
``finish``) and torchtitan's ``protocols/state_dict_adapter.py``: an ``OutputKind`` says which
groups the output holds (``groups``), how its files are placed from the items before any data is
read (names, shards, every tensor's byte offset: ``plan_files``), how each file is finished once
the workers wrote its tensors (``FileKind.finish_file``: headers, pickle) and how the folder is
finished (``write_index``: HF's weight map; ``finish``: adapter config, HF assets). The plan
carries the object (``plan.WorkPlan.kind``), and neither ``plan/consolidate.py`` nor ``ops/`` compares a
kind's name.

What is known of a kind without torch is its row in ``output_table.OUTPUT_ROWS``: the
``--format`` name and suffixes that choose it, whether it is a folder, the files it writes and
how they are read back (``formats.full_file``). Each class here takes its name, folder flag and
file names from its row (``RowKind``); ``output_kind`` asks the table for the row and returns the
row's class from ``OUTPUT_KINDS``. To add an output kind: its row in ``output_table.py`` and its
class with its entry in ``OUTPUT_KINDS`` (docs/architecture.md, "An output kind";
``tests/unit/test_output_kind_extension.py`` adds two kinds in the test alone).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fsdp_convert import output_table, producers
from fsdp_convert.lora import LoraOptions
from fsdp_convert.output_table import OutputRow, choose_row, last_files
from fsdp_convert.outputs.dcp_folder import DcpFolder
from fsdp_convert.outputs.files import RECORD_TAIL_BYTES, SafetensorsFile, TorchSaveFile
from fsdp_convert.outputs.folders import HfFolder, PeftAdapterFolder, plan_shards
from fsdp_convert.outputs.kind import (
    FileKind,
    FilePlan,
    Only,
    Output,
    OutputKind,
    RequestedFormat,
    RowKind,
    stored_bytes,
    value_tensor,
)
from fsdp_convert.own_files import OwnFiles

__all__ = [
    "Only",
    "RequestedFormat",
    "FilePlan",
    "FileKind",
    "RowKind",
    "Output",
    "OutputKind",
    "value_tensor",
    "stored_bytes",
    "TorchSaveFile",
    "SafetensorsFile",
    "HfFolder",
    "PeftAdapterFolder",
    "DcpFolder",
    "OUTPUT_KINDS",
    "kind_of",
    "output_kind",
    "reshard_kind",
    "own_files",
    "last_files",
    "plan_shards",
    "RECORD_TAIL_BYTES",
]


# One instance per row of output_table.OUTPUT_ROWS (found by the row's name); a new kind is one entry here.
OUTPUT_KINDS: tuple[OutputKind | DcpFolder, ...] = (
    TorchSaveFile(),
    SafetensorsFile(),
    HfFolder(),
    PeftAdapterFolder(),
    DcpFolder(),
)


def kind_of(row: OutputRow) -> OutputKind | DcpFolder:
    """The entry of ``OUTPUT_KINDS`` whose row is ``row`` (by name).

    Raises:
        LookupError: no class has that row (a row added to the table without its class).
    """
    kind = next((k for k in OUTPUT_KINDS if k.row.name == row.name), None)
    if kind is None:
        raise LookupError(f"the output row {row.name!r} has no class in outputs.OUTPUT_KINDS")
    return kind


def output_kind(output: Path, requested: RequestedFormat = "auto", *, lora: LoraOptions | None = None) -> OutputKind:
    """The output kind OUT, ``--format`` and ``--lora-only`` ask for: the class of ``output_table.choose_row``'s row.

    ``auto``: ``.pt``/``.pth``/``.bin`` is one torch.save file; ``.safetensors`` one safetensors
    file; no suffix, or an existing folder, a Hugging Face folder (safetensors shards plus index).
    ``torch``: one torch.save file, whatever the name (Lightning's ``.ckpt``), unless it names a
    folder or a ``.safetensors`` file. ``safetensors``: a ``.safetensors`` file, or else a Hugging
    Face folder. With ``lora`` (``--lora-only``), a folder is a PEFT adapter folder holding ``lora``.

    Raises:
        InvalidOptionError: an unknown ``--format``, an unknown suffix with ``auto`` (the message
            suggests ``--format torch``), a name that contradicts ``requested``, or ``lora`` with a file OUT.
    """
    kind = kind_of(choose_row(output, requested, lora_only=lora is not None))
    if isinstance(kind, DcpFolder):  # never: choose_row takes consolidate's rows only
        raise LookupError(f"{kind.row.name!r} is reshard's output, not consolidate's")
    if isinstance(kind, PeftAdapterFolder):  # the row --lora-only chose holds the adapter's options
        return dataclasses.replace(kind, lora=lora)
    return kind


def own_files() -> OwnFiles:
    """The names this tool writes in an output folder, read from the tables when called.

    Every output kind's (``output_table.own_files``) and the files beside each producer's data that
    ``reshard`` copies (``producers.own_files``). ``--overwrite`` replaces a folder holding only
    these without ``--force`` (``writers.check_output``).
    """
    return output_table.own_files() | producers.own_files()


def reshard_kind() -> DcpFolder:
    """``reshard``'s output kind: the class of the row ``reshard`` chooses (``output_table.DCP_ROW``).

    Raises:
        LookupError: the table has no such row, or its class is not a ``DcpFolder``.
    """
    row = next((r for r in output_table.OUTPUT_ROWS if r.chosen_by == "reshard"), None)
    kind = None if row is None else kind_of(row)
    if not isinstance(kind, DcpFolder):
        raise LookupError("the outputs table has no DCP folder row for reshard")
    return kind
