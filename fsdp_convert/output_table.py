"""The outputs table: one row per output kind, without torch, asked by the CLI, the output check and read-back.

An ``OutputRow`` holds what is known of a kind before torch is imported: the ``--format`` name
that chooses it, the suffixes it claims with ``--format auto``, whether it is a folder, the files
it writes (name patterns, and subfolders with the names inside), how a written folder is read
back (its ``FolderFile`` records: which file holds which group, nested under which state-dict
path), and the messages that refuse it. Each fact has its home here:

- ``choose_row`` picks the row OUT, ``--format`` and ``--lora-only`` ask for: the command line's
  precheck (``cli._precheck``) calls it before torch is imported, and ``outputs.output_kind``
  calls it and returns the row's class (``outputs.OUTPUT_KINDS``), which takes its name, folder
  flag and file names from its row;
- ``format_names`` lists ``--format``'s values (the CLI's choices, ``ops.options``' check);
- ``own_files`` is every row's written names, which the output check (``writers.check_output``)
  takes as this tool's own;
- ``folder_files`` and ``suffixes_holding`` say how ``formats.full_file`` reads an output back.

A leaf below ``formats`` and ``writers``: it imports only ``errors`` and ``own_files``. A new kind
is one row in ``OUTPUT_ROWS`` and its class in ``outputs`` (docs/architecture.md, "An output kind").
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.own_files import OwnFiles

__all__ = [
    "RequestedFormat",
    "METADATA_FILENAME",
    "HF_INDEX_FILENAME",
    "HF_SINGLE_FILENAME",
    "HF_SHARD_FILENAME",
    "OPTIMIZER_FILENAME",
    "EXTRA_STATE_FILENAME",
    "ADAPTER_WEIGHTS_FILENAME",
    "ADAPTER_CONFIG_FILENAME",
    "CONFIG_FILENAME",
    "CHAT_TEMPLATE_DIR",
    "ASSET_FILENAMES",
    "TORCH_SAVE_SUFFIXES",
    "SAFETENSORS_SUFFIXES",
    "FolderFile",
    "OutputRow",
    "TORCH_SAVE_ROW",
    "SAFETENSORS_ROW",
    "HF_ROW",
    "PEFT_ROW",
    "DCP_ROW",
    "OUTPUT_ROWS",
    "format_names",
    "check_format",
    "choose_row",
    "check_only",
    "check_verifiable",
    "last_files",
    "own_files",
    "folder_files",
    "suffixes_holding",
]

RequestedFormat = str  # a --format value: "auto" or a row's format name (format_names())

METADATA_FILENAME = ".metadata"  # DCP's pickled Metadata, FileSystemWriter.finish
HF_INDEX_FILENAME = "model.safetensors.index.json"  # weight_map of a sharded Hugging Face folder
HF_SINGLE_FILENAME = "model.safetensors"  # an unsharded Hugging Face folder's one file
HF_SHARD_FILENAME = "model-{k:05d}-of-{n:05d}.safetensors"  # shard k of n (from 1), as save_pretrained names it
_HF_SHARD_PATTERN = r"model-\d{5,}-of-\d{5,}\.safetensors"  # every name HF_SHARD_FILENAME gives
OPTIMIZER_FILENAME = "optimizer.pt"  # beside HF shards, as transformers' Trainer names it
EXTRA_STATE_FILENAME = "extra_state.pt"
ADAPTER_WEIGHTS_FILENAME = "adapter_model.safetensors"  # a PEFT adapter folder's: peft.utils.constants.SAFETENSORS_WEIGHTS_NAME
ADAPTER_CONFIG_FILENAME = "adapter_config.json"  # peft.utils.constants.CONFIG_NAME
CONFIG_FILENAME = "config.json"  # transformers' CONFIG_NAME
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # transformers' CHAT_TEMPLATE_DIR: named templates, <name>.jinja
_DCP_DATA_PATTERN = r"__\d+_\d+\.distcp"  # FileSystemWriter's data files (writers.dcp.rank_filename)

TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save of the nested state dict (``--format auto``)
SAFETENSORS_SUFFIXES = (".safetensors",)  # safetensors of the model weights

# What transformers' save_pretrained writes beside the weights (4.45 to 5.23), which --hf-assets copies
# (writers.hf_assets): the config and generation config; a tokenizer's files (tokenization_utils_base:
# TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, ADDED_TOKENS_FILE, FULL_TOKENIZER_FILE, CHAT_TEMPLATE_FILE,
# and every value of a tokenizer class's VOCAB_FILES_NAMES in transformers/models/*/tokenization_*.py); a
# processor's, image processor's, feature extractor's and video processor's configs.
ASSET_FILENAMES: frozenset[str] = frozenset(
    {
        *(CONFIG_FILENAME, "generation_config.json"),
        *("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json"),
        *("chat_template.jinja", "chat_template.json"),
        *("tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.model"),
        *("sentencepiece.bpe.model", "spm.model", "spm_char.model", "source.spm", "target.spm", "bpe.codes"),
        *("dict.txt", "emoji.json", "entity_vocab.json", "byte_maps.json", "normalizer.json", "prophetnet.tokenizer"),
        *("target_vocab.json", "vocab-src.json", "vocab-tgt.json", "word_pronunciation.json", "word_shape.json"),
        *("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"),
        "audio_tokenizer_config.json",
    }
)
_ASSETS = tuple(re.escape(name) for name in sorted(ASSET_FILENAMES))
_CHAT_TEMPLATES = ((re.escape(CHAT_TEMPLATE_DIR), r"(?s:.*)\.jinja"),)  # the folder, and the files it may hold

_UNKNOWN_SUFFIX = (
    "{output}: unknown output suffix {suffix!r}; use one of {known} or a folder name, "
    "or --format torch to write a torch.save file under this name"
)
_NOT_WRITTEN = "{output}: --format {format} does not write {what}"  # a row's chooser without a refusal of its own


@dataclass(frozen=True, slots=True)
class FolderFile:
    """One torch.save or safetensors file of a folder output, as it is written and read back.

    Attributes:
        name: its name in the folder.
        content: ``torch_save``; ``safetensors`` (the weights, one file); ``safetensors_index``
            (a ``weight_map`` JSON naming the weights' shards).
        group: the state dict's group it holds: ``model``, ``optim`` or ``other``.
        nest: the state-dict path its dict nests under: ``("optim",)`` for ``optimizer.pt``,
            which holds the optimizer state dict itself, ``()`` for a file of top-level keys.
            Safetensors weights nest under ``("model",)``.
    """

    name: str
    content: Literal["torch_save", "safetensors", "safetensors_index"]
    group: Literal["model", "optim", "other"]
    nest: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputRow:
    """One output kind, as known before torch is imported.

    Attributes:
        name: the row's own name, which its class in ``outputs.OUTPUT_KINDS`` names, and the
            result's ``output_format`` (unless ``reported_as``).
        reported_as: the result's ``output_format`` when it is not ``name``.
        format: the ``--format`` name that chooses it (rows may share one: ``safetensors`` is a
            file or a Hugging Face folder); None: no ``--format`` names it.
        chosen_by: ``out`` (OUT's name and ``--format``), ``lora_only`` (``--lora-only``, where
            OUT and ``--format`` choose the row ``instead_of`` names) or ``reshard``.
        instead_of: for ``lora_only``, the row it takes the place of.
        suffixes: OUT suffixes (lower case) it claims with ``--format auto``, and with its ``format``.
        folder: whether OUT is a folder.
        bare_names: with ``auto``, it takes a name without a suffix, or an existing folder.
        any_name: with its ``format``, it takes any name whose suffix no row of another format
            claims (a file row: not an existing folder).
        content: a file row's bytes, ``torch_save`` or ``safetensors`` (read back by its bytes,
            or by these suffixes when the bytes say nothing); None for a folder.
        files: patterns (``re.fullmatch``) of the top-level files it writes in a folder, besides
            its ``folder_files``.
        subfolders: (pattern of a subfolder's name, pattern of every file inside it) it writes.
        folder_files: its torch.save and safetensors files, in the order they are read back.
        last: files written last (uploaded after all others to a URL).
        optim_refusal: why ``--only optim`` is refused (it holds the model weights alone); None: taken.
        refusal: the message when its chooser (its ``format``, or ``--lora-only``) finds no row
            for OUT; ``{output}``, ``{suffix}`` (OUT's), ``{what}`` and ``{format}`` are filled in.
        verify_refusal: why ``--verify`` does not read it back; None: it does.
    """

    name: str
    reported_as: str | None = None
    format: str | None = None
    chosen_by: Literal["out", "lora_only", "reshard"] = "out"
    instead_of: str | None = None
    suffixes: tuple[str, ...] = ()
    folder: bool = False
    bare_names: bool = False
    any_name: bool = False
    content: Literal["torch_save", "safetensors"] | None = None
    files: tuple[str, ...] = ()
    subfolders: tuple[tuple[str, str], ...] = ()
    folder_files: tuple[FolderFile, ...] = ()
    last: tuple[str, ...] = ()
    optim_refusal: str | None = None
    refusal: str | None = None
    verify_refusal: str | None = None

    @property
    def output_format(self) -> str:
        """The result's ``output_format``: ``reported_as``, else ``name``."""
        return self.reported_as or self.name


_OPTIMIZER = FolderFile(OPTIMIZER_FILENAME, "torch_save", "optim", ("optim",))
_EXTRA_STATE = FolderFile(EXTRA_STATE_FILENAME, "torch_save", "other")

TORCH_SAVE_ROW = OutputRow(
    name="torch_save",
    format="torch",
    suffixes=TORCH_SAVE_SUFFIXES,
    any_name=True,
    content="torch_save",
    refusal="{output}: --format torch writes one torch.save file, not {what}",
)
SAFETENSORS_ROW = OutputRow(
    name="safetensors",
    format="safetensors",
    suffixes=SAFETENSORS_SUFFIXES,
    content="safetensors",
    optim_refusal="a .safetensors file holds model weights only; use a .pt file or a folder for optimizer state",
    refusal="{output}: --format safetensors needs a .safetensors name or a folder, not {suffix!r}",
)
HF_ROW = OutputRow(
    name="hf_dir",
    format="safetensors",
    folder=True,
    bare_names=True,
    any_name=True,
    files=(_HF_SHARD_PATTERN, *_ASSETS),
    subfolders=_CHAT_TEMPLATES,
    folder_files=(
        FolderFile(HF_INDEX_FILENAME, "safetensors_index", "model", ("model",)),
        FolderFile(HF_SINGLE_FILENAME, "safetensors", "model", ("model",)),
        _OPTIMIZER,
        _EXTRA_STATE,
    ),
    last=(HF_SINGLE_FILENAME, HF_INDEX_FILENAME),
)
PEFT_ROW = OutputRow(
    name="peft_adapter",
    reported_as="hf_dir",
    chosen_by="lora_only",
    instead_of="hf_dir",
    folder=True,
    files=(re.escape(ADAPTER_CONFIG_FILENAME), *_ASSETS),
    subfolders=_CHAT_TEMPLATES,
    folder_files=(FolderFile(ADAPTER_WEIGHTS_FILENAME, "safetensors", "model", ("model",)), _OPTIMIZER, _EXTRA_STATE),
    refusal="{output}: --lora-only writes a PEFT adapter folder; name OUT without a suffix",
    verify_refusal="--verify does not read a PEFT adapter folder back; load it with PeftModel.from_pretrained",
)
DCP_ROW = OutputRow(
    name="dcp",
    chosen_by="reshard",
    folder=True,
    files=(re.escape(METADATA_FILENAME), _DCP_DATA_PATTERN),
    last=(METADATA_FILENAME,),
)

# The output kinds, in the order choose_row asks them whether they take OUT (the first that does).
OUTPUT_ROWS: tuple[OutputRow, ...] = (TORCH_SAVE_ROW, SAFETENSORS_ROW, HF_ROW, PEFT_ROW, DCP_ROW)


def _listed(names: tuple[str, ...]) -> str:
    """``a, b or c``."""
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last


def format_names() -> tuple[str, ...]:
    """``--format``'s values: ``auto``, then every row's ``format``, in table order, each once."""
    return tuple(dict.fromkeys(("auto", *(row.format for row in OUTPUT_ROWS if row.format is not None))))


def check_format(requested: object) -> RequestedFormat:
    """``requested`` as a plain string, if it is one of ``format_names()`` (a CLI ``str`` enum member too).

    Raises:
        InvalidOptionError: anything else (``--format 'gguf': use auto, torch or safetensors``).
    """
    names = format_names()
    if isinstance(requested, str) and requested in names:
        return names[names.index(requested)]
    raise InvalidOptionError(f"--format {requested!r}: use {_listed(names)}")


def _claims(row: OutputRow, output: Path, requested: str) -> bool:
    """Whether ``row`` takes ``output`` under ``--format requested`` (its ``suffixes``, ``bare_names``, ``any_name``)."""
    suffix = output.suffix.lower()
    if requested == "auto":
        return suffix in row.suffixes or (row.bare_names and (suffix == "" or output.is_dir()))
    if row.format != requested:
        return False
    if not row.any_name:
        return suffix in row.suffixes
    others = {s for other in OUTPUT_ROWS if other.format != requested for s in other.suffixes}
    return suffix not in others and (row.folder or not output.is_dir())


def _refusal(row_refusal: str | None, output: Path, requested: str) -> str:
    what = "an existing folder" if output.is_dir() else f"a {output.suffix} name"
    template = row_refusal or _NOT_WRITTEN
    return template.format(output=output, suffix=output.suffix, what=what, format=requested)


def choose_row(output: Path, requested: RequestedFormat = "auto", *, lora_only: bool = False) -> OutputRow:
    """The row OUT, ``--format`` and ``--lora-only`` ask for: the first of ``OUTPUT_ROWS`` chosen by OUT that takes it.

    ``auto``: ``.pt``/``.pth``/``.bin`` is one torch.save file; ``.safetensors`` one safetensors
    file; no suffix, or an existing folder, a Hugging Face folder. ``torch``: one torch.save file,
    whatever the name (Lightning's ``.ckpt``), unless it names a folder or a ``.safetensors`` file.
    ``safetensors``: a ``.safetensors`` file, or else a Hugging Face folder. With ``lora_only``,
    the row chosen by ``--lora-only`` in place of the one chosen (a PEFT adapter folder for a folder).

    Raises:
        InvalidOptionError: an unknown ``--format``; an unknown suffix with ``auto`` (the message
            suggests ``--format torch``); a name that contradicts ``requested``; ``lora_only``
            where OUT names another kind (a file).
    """
    requested = check_format(requested)
    row = next((r for r in OUTPUT_ROWS if r.chosen_by == "out" and _claims(r, output, requested)), None)
    if row is None and requested == "auto":
        known = ", ".join(s for r in OUTPUT_ROWS if r.chosen_by == "out" for s in r.suffixes)
        raise InvalidOptionError(_UNKNOWN_SUFFIX.format(output=output, suffix=output.suffix, known=known))
    if row is None:
        refusal = next((r.refusal for r in OUTPUT_ROWS if r.format == requested and r.refusal), None)
        raise InvalidOptionError(_refusal(refusal, output, requested))
    if not lora_only:
        return row
    instead = next((r for r in OUTPUT_ROWS if r.chosen_by == "lora_only" and r.instead_of == row.name), None)
    if instead is None:
        refusal = next((r.refusal for r in OUTPUT_ROWS if r.chosen_by == "lora_only"), None)
        raise InvalidOptionError(_refusal(refusal, output, requested))
    return instead


def check_only(row: OutputRow, only: str) -> None:
    """Refuse ``--only optim`` for a row holding the model weights alone (``optim_refusal``).

    Raises:
        InvalidOptionError: ``only`` is ``optim`` and the row has an ``optim_refusal``.
    """
    if only == "optim" and row.optim_refusal is not None:
        raise InvalidOptionError(row.optim_refusal)


def check_verifiable(row: OutputRow) -> None:
    """Refuse ``--verify`` for a row it does not read back (``verify_refusal``).

    Raises:
        InvalidOptionError: the row has a ``verify_refusal``.
    """
    if row.verify_refusal is not None:
        raise InvalidOptionError(row.verify_refusal)


def last_files() -> tuple[str, ...]:
    """Every ``consolidate`` row's files written last, for a transaction opened before OUT's kind is known."""
    return tuple(dict.fromkeys(name for row in OUTPUT_ROWS if row.chosen_by != "reshard" for name in row.last))


@functools.lru_cache(maxsize=64)
def _row_files(row: OutputRow) -> OwnFiles:
    """The names ``row`` writes at the top of an output folder, compiled."""
    patterns = (*row.files, *(re.escape(f.name) for f in row.folder_files))
    files = (re.compile("|".join(f"(?:{p})" for p in patterns)),) if patterns else ()
    return OwnFiles(files=files, folders=tuple((re.compile(outer), re.compile(inner)) for outer, inner in row.subfolders))


def own_files() -> OwnFiles:
    """The names every row writes in an output folder (read from ``OUTPUT_ROWS`` now: a row added since counts)."""
    own = OwnFiles()
    for row in OUTPUT_ROWS:
        own = own | _row_files(row)
    return own


def folder_files(content: Literal["torch_save", "safetensors", "safetensors_index"] | None = None) -> tuple[FolderFile, ...]:
    """Every folder row's ``FolderFile`` records of ``content`` (None: all), in table order, each name once.

    ``formats.full_file`` reads a folder back by them: a folder holding one of them (and no
    ``.metadata``) is an output of this tool.
    """
    seen: dict[str, FolderFile] = {}
    for row in OUTPUT_ROWS:
        for f in row.folder_files:
            if (content is None or f.content == content) and f.name not in seen:
                seen[f.name] = f
    return tuple(seen.values())


def suffixes_holding(content: Literal["torch_save", "safetensors"]) -> tuple[str, ...]:
    """The suffixes of the file rows whose bytes are ``content``, in table order."""
    return tuple(dict.fromkeys(s for row in OUTPUT_ROWS if row.content == content for s in row.suffixes))
