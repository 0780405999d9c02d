"""Output kinds: what ``consolidate`` writes, one object per kind, chosen once from OUT and ``--format``.

After torch DCP's ``StorageWriter`` (``HuggingFaceStorageWriter`` overrides ``write_data`` and
``finish``) and torchtitan's ``protocols/state_dict_adapter.py``: an ``OutputKind`` says which
groups the output holds (``groups``), how its files are placed from the items before any data is
read (names, shards, every tensor's byte offset: ``plan_files``), how each file is finished once
the workers wrote its tensors (``FileKind.finish_file``: headers, pickle) and how the folder is
finished (``write_index``: HF's weight map; ``finish``: adapter config, HF assets). The plan
carries the object (``plan.WorkPlan.kind``), and neither ``plan.py`` nor ``ops/`` compares a
kind's name. A written output is read back (``--verify``, or as an input) by
``formats.full_file``, which knows each kind's files by their bytes and names.

To add an output kind: a class with the ``OutputKind`` members (a file output is its own
``FileKind``; a folder's files are ``TorchSaveFile``/``SafetensorsFile`` or a new ``FileKind``)
and one entry in ``OUTPUT_KINDS``, where ``output_kind`` takes the first kind that ``claims`` OUT:
this module, plus the writer in ``writers/`` of a new byte format
(``tests/unit/test_output_kind_extension.py`` adds two kinds in the test alone).
"""

from __future__ import annotations

from pathlib import Path

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.lora import LoraOptions
from fsdp_convert.outputs.files import RECORD_TAIL_BYTES, SafetensorsFile, TorchSaveFile
from fsdp_convert.outputs.folders import HfFolder, PeftAdapterFolder, plan_shards
from fsdp_convert.outputs.kind import FileKind, FilePlan, Only, OutputKind, RequestedFormat, stored_bytes, value_tensor

__all__ = [
    "Only",
    "RequestedFormat",
    "FilePlan",
    "FileKind",
    "OutputKind",
    "value_tensor",
    "stored_bytes",
    "TorchSaveFile",
    "SafetensorsFile",
    "HfFolder",
    "PeftAdapterFolder",
    "OUTPUT_KINDS",
    "output_kind",
    "last_files",
    "plan_shards",
    "RECORD_TAIL_BYTES",
]


# The output kinds, in the order ``output_kind`` asks them whether they write OUT (the first that
# claims it does). A new kind is one entry here.
OUTPUT_KINDS: tuple[OutputKind, ...] = (TorchSaveFile(), SafetensorsFile(), HfFolder())


def output_kind(output: Path, requested: RequestedFormat = "auto", *, lora: LoraOptions | None = None) -> OutputKind:
    """The output kind OUT (and ``--format``, and ``--lora-only``) asks for: the first of ``OUTPUT_KINDS`` that claims it.

    ``auto``: ``.pt``/``.pth``/``.bin`` is one torch.save file; ``.safetensors`` one safetensors
    file; no suffix, or an existing folder, a Hugging Face folder (safetensors shards plus index).
    ``torch``: one torch.save file, whatever the name (Lightning's ``.ckpt``), unless it names a
    folder or a ``.safetensors`` file. ``safetensors``: a ``.safetensors`` file, or else a Hugging
    Face folder. With ``lora`` (``--lora-only``), a folder is a PEFT adapter folder.

    Raises:
        InvalidOptionError: an unknown suffix with ``auto`` (the message suggests ``--format
            torch``), a name that contradicts ``requested``, or ``lora`` with a file OUT.
    """
    if requested not in ("auto", "torch", "safetensors"):
        raise InvalidOptionError(f"--format {requested!r}: use auto, torch or safetensors")
    kind = next((k for k in OUTPUT_KINDS if k.claims(output, requested)), None)
    if kind is None:
        raise InvalidOptionError(_refusal(output, requested))
    if lora is not None:
        if not isinstance(kind, HfFolder):
            raise InvalidOptionError(f"{output}: --lora-only writes a PEFT adapter folder; name OUT without a suffix")
        return PeftAdapterFolder(lora=lora)
    return kind


def _refusal(output: Path, requested: RequestedFormat) -> str:
    """Why no kind writes ``output`` under ``--format requested``."""
    if requested == "torch":
        what = "an existing folder" if output.is_dir() else f"a {output.suffix} name"
        return f"{output}: --format torch writes one torch.save file, not {what}"
    if requested == "safetensors":
        return f"{output}: --format safetensors needs a .safetensors name or a folder, not {output.suffix!r}"
    known = ", ".join(s for k in OUTPUT_KINDS for s in k.suffixes)
    return (
        f"{output}: unknown output suffix {output.suffix!r}; use one of {known} or a folder name, "
        "or --format torch to write a torch.save file under this name"
    )


def last_files() -> tuple[str, ...]:
    """Every kind's files written last (``OutputKind.last``), for a transaction opened before OUT's kind is known."""
    return tuple(dict.fromkeys(name for kind in OUTPUT_KINDS for name in kind.last))
