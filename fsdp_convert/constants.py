"""Format constants shared by readers and writers: file names, suffixes, the safetensors dtype table.

A leaf: it imports only torch. DCP's own names come from ``torch/distributed/checkpoint``
(``filesystem.py`` writes ``.metadata``); Hugging Face's from transformers' ``save_pretrained``
and Trainer; safetensors' dtype names from its format description
(https://github.com/huggingface/safetensors, "Format").
"""

from __future__ import annotations

import torch

__all__ = [
    "METADATA_FILENAME",
    "HF_INDEX_FILENAME",
    "HF_SINGLE_FILENAME",
    "OPTIMIZER_FILENAME",
    "EXTRA_STATE_FILENAME",
    "TORCH_SAVE_SUFFIXES",
    "SAFETENSORS_SUFFIXES",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_TO_TORCH",
    "SUPPORTED_DTYPES",
    "READ_LOG_ENV",
]

METADATA_FILENAME = ".metadata"  # DCP's pickled Metadata, FileSystemWriter.finish
HF_INDEX_FILENAME = "model.safetensors.index.json"  # weight_map of a sharded Hugging Face folder
HF_SINGLE_FILENAME = "model.safetensors"  # an unsharded Hugging Face folder's one file
OPTIMIZER_FILENAME = "optimizer.pt"  # beside HF shards, as transformers' Trainer names it
EXTRA_STATE_FILENAME = "extra_state.pt"
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIXES = (".safetensors",)

# torch dtype -> safetensors dtype name (the header's "dtype"); the one table, inverted below
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
# safetensors dtype name -> torch dtype (the inverse of SAFETENSORS_DTYPES)
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}

# dtypes a full tensor can be allocated, written by torch.save and read back for (no quantized types)
SUPPORTED_DTYPES = frozenset(
    {
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
        torch.complex128, torch.complex64, torch.complex32,
        torch.int64, torch.int32, torch.int16, torch.int8,
        torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
    }
)  # fmt: skip

# FSDP_CONVERT_READ_LOG=<folder>: every reader appends one JSON line per chunk it reads to
# <folder>/reads-<pid>.jsonl (which worker read what; the tests check the split of the reads)
READ_LOG_ENV = "FSDP_CONVERT_READ_LOG"
