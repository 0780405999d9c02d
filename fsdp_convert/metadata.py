"""Transitional re-exports of ``fsdp_convert.formats`` (issue 12); removed once every importer moved."""

from fsdp_convert.constants import METADATA_FILENAME, SUPPORTED_DTYPES
from fsdp_convert.formats import read_index
from fsdp_convert.formats._dcp_metadata import build_index, load_metadata, metadata_from_bytes
from fsdp_convert.formats.dcp import LIGHTNING_META_FILENAME
from fsdp_convert.formats.index import (
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    ObjPath,
    TensorEntry,
    dtype_name,
)

__all__ = [
    "METADATA_FILENAME",
    "SUPPORTED_DTYPES",
    "LIGHTNING_META_FILENAME",
    "ChunkEntry",
    "TensorEntry",
    "BytesEntry",
    "Entry",
    "ObjPath",
    "CheckpointIndex",
    "read_index",
    "load_metadata",
    "metadata_from_bytes",
    "build_index",
    "dtype_name",
]
