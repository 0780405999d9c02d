"""Read stage, whole files: what a file holds by its first bytes, small JSON files, safetensors headers, torch.save files.

Files read whole or by their head, not chunk by chunk: a file's magic, a safetensors header
(a full checkpoint's file, or a data file of ``hf_storage``), a small JSON file up to a cap, a
torch.save file memory-mapped; each opened inside its checkpoint folder (``location.open_inside``).
Error messages say what is wrong in words that quote none of the file's bytes: a file may hold anything.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Literal

from fsdp_convert.errors import CorruptChunkError, UnsafeContentError
from fsdp_convert.held_roots import open_inside
from fsdp_convert.location import read_inside

__all__ = [
    "MAX_HEADER_BYTES",
    "json_problem",
    "library_problem",
    "short_message",
    "read_json_file",
    "read_safetensors_header",
    "sniff_file",
    "load_torch_save",
]

MAX_HEADER_BYTES = 100 * 2**20  # safetensors refuses larger headers
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format: a local file header first
# torch.save's legacy format (_use_new_zipfile_serialization=False): pickle protocol 2, then the
# magic number 0x1950a86a20f9469cfc6c as a 10-byte LONG1 (torch/serialization.py MAGIC_NUMBER)
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_QUOTE = re.compile(r'["`]')  # a parser (the safetensors library's serde) quotes the file's text after one


def json_problem(e: ValueError) -> str:
    """What is wrong with JSON that did not parse, in words that quote none of its bytes."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at byte {e.pos}"  # the decoder's messages name a position, never the text
    if isinstance(e, UnicodeDecodeError):
        return "it is not UTF-8"
    return "it is not JSON"


def library_problem(e: BaseException) -> str:
    """A library's complaint about a file (``short_message``), cut before the first thing it quotes from the file."""
    text = short_message(e)
    quote = _QUOTE.search(text)
    return text if quote is None else text[: quote.start()].rstrip() + " ..."


def read_json_file(root: Path, path: Path, max_bytes: int) -> Any:
    """A small JSON file of a checkpoint folder, parsed: read whole if at most ``max_bytes``, else refused.

    Raises:
        CorruptChunkError: larger than ``max_bytes``, unreadable, or not JSON (messages quote none of it).
        UnsafeContentError: a symbolic link out of ``root`` (``location.open_inside``).
    """
    try:
        raw = read_inside(root, path, max_bytes)
        if raw is None:
            raise CorruptChunkError(f"{path} is larger than {max_bytes} bytes; refused")
        return json.loads(raw)
    except OSError as e:
        raise CorruptChunkError(f"{path}: not readable ({e.strerror})") from e
    except RecursionError as e:
        raise CorruptChunkError(f"{path}: not readable JSON (it nests too deeply)") from e
    except ValueError as e:
        raise CorruptChunkError(f"{path}: not readable JSON ({json_problem(e)})") from e


def read_safetensors_header(path: Path, *, root: Path | None = None) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and where its data starts, in bytes.

    Format: an 8-byte little-endian header length N, N bytes of JSON, then the data. Messages
    never quote the file's bytes (a length that does not fit is said to, not given).

    Args:
        path: the file.
        root: the checkpoint folder it is part of; a link out of it is refused
            (``location.open_inside``). None: ``path`` is what the user named.

    Raises:
        CorruptChunkError: truncated file, oversized or malformed header, not a regular file.
        UnsafeContentError: a symbolic link out of ``root``.
    """
    try:
        with open(open_inside(root or path, path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise CorruptChunkError(f"{path}: not a readable safetensors file (no header length; truncated)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CorruptChunkError(
                    f"{path}: not a readable safetensors file (the header length does not fit the file, {size} bytes)"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        raise CorruptChunkError(f"{path}: not a readable safetensors file ({e.strerror})") from e
    except RecursionError as e:
        raise CorruptChunkError(f"{path}: not a readable safetensors file (its header nests too deeply)") from e
    except ValueError as e:
        raise CorruptChunkError(f"{path}: not a readable safetensors file (its header: {json_problem(e)})") from e
    if not isinstance(header, dict):
        raise CorruptChunkError(f"{path}: not a readable safetensors file (its header is not a JSON object)")
    return header, 8 + n


def sniff_file(path: Path, *, root: Path | None = None) -> Literal["torch_save", "legacy_torch_save", "safetensors"] | None:
    """What a file holds, from its first bytes: a torch.save zip, a legacy torch.save pickle, safetensors, or None.

    Reads at most 14 bytes (a safetensors file: an 8-byte header length that fits the file, then ``{``).

    Args:
        path: the file.
        root: as for ``read_safetensors_header``.

    Raises:
        CorruptChunkError: the file cannot be read, or is not a regular file.
        UnsafeContentError: a symbolic link out of ``root``.
    """
    try:
        with open(open_inside(root or path, path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(len(_LEGACY_TORCH_MAGIC))
    except OSError as e:
        raise CorruptChunkError(f"cannot read {path}: {e.strerror}") from e
    if head.startswith(_ZIP_MAGIC):
        return "torch_save"
    if head.startswith(_LEGACY_TORCH_MAGIC):
        return "legacy_torch_save"
    if len(head) >= 9 and head[8:9] == b"{" and 8 + struct.unpack("<Q", head[:8])[0] <= size:
        return "safetensors"
    return None


def short_message(e: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none), for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_torch_save(path: Path, *, root: Path | None = None) -> Any:
    """``torch.load`` of a whole torch.save file with ``weights_only=True``, memory-mapped.

    The legacy (non-zip) format cannot be memory-mapped; it is read into memory.

    Args:
        path: the file.
        root: as for ``read_safetensors_header``.

    Raises:
        UnsafeContentError: a pickle that would run code, or a symbolic link out of ``root``.
        CorruptChunkError: not a readable torch.save file.
    """
    import torch

    legacy = sniff_file(path, root=root) == "legacy_torch_save"
    try:
        fd = open_inside(root or path, path)  # loaded through the descriptor: never by name after a check
    except OSError as e:
        raise CorruptChunkError(f"cannot read {path}: {e.strerror}") from e
    try:
        return torch.load(f"/proc/self/fd/{fd}", map_location="cpu", weights_only=True, mmap=not legacy)
    except Exception as e:
        detail = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), None)
        if detail is not None:
            raise UnsafeContentError(f"{path}: would run code when loaded, refused ({detail})") from e
        raise CorruptChunkError(f"{path}: not a readable torch.save file ({type(e).__name__}: {short_message(e)})") from e
    finally:
        os.close(fd)  # a memory map of it keeps the file itself
