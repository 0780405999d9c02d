"""Format constants shared by readers and writers: the safetensors dtype table and shape rule (file names: ``output_table``).

A leaf, torch-free until a torch table is first used: the tables keyed by torch dtypes are built
then (``__getattr__``), so reading a checkpoint's index imports no torch. DCP's own names come
from ``torch/distributed/checkpoint`` (``filesystem.py`` writes ``.metadata``); Hugging Face's
from transformers' ``save_pretrained`` and Trainer; safetensors' dtype names from its format description
(https://github.com/huggingface/safetensors, "Format").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdp_convert.dtypes import CAST_NAMES, SAFETENSORS_NAMES, UNCASTABLE, VALUES_PER_ELEMENT, DType

__all__ = [
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_TO_TORCH",
    "SAFETENSORS_VALUES_PER_ELEMENT",
    "safetensors_shape",
    "torch_shape",
    "UNCASTABLE_DTYPES",
    "SUPPORTED_DTYPES",
    "TORCH_DTYPE_NAMES",
    "STORAGE_DTYPE_NAMES",
    "DTYPE_NAMES",
    "READ_LOG_ENV",
    "WORKER_PRELOAD",
    "quiet_workers",
]

# every torch dtype a pickle may name (``GLOBAL torch <name>``), aliases included, to its canonical
# name (``str(dtype)`` without ``torch.``), for .metadata's torch-free unpickler (formats/_dcp_records.py);
# tests/unit/test_startup.py checks each against torch
TORCH_DTYPE_NAMES: dict[str, str] = {
    **{n: n for n in (
        "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32", "complex64",
        "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
        "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64",
        "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1", "uint16", "uint2", "uint3", "uint32",
        "uint4", "uint5", "uint6", "uint64", "uint7", "uint8",
    )},
    "bit": "uint1", "cdouble": "complex128", "cfloat": "complex64", "chalf": "complex32", "double": "float64",
    "float": "float32", "half": "float16", "int": "int32", "long": "int64", "short": "int16",
}  # fmt: skip

# torch's legacy typed-storage classes (``torch.FloatStorage``), which torch.save pickles for a tensor's
# storage, to the dtype each holds (``torch.storage._dtype_to_storage_type_map``); other dtypes pickle
# an ``UntypedStorage`` and name the dtype. tests/unit/test_payload_pickle.py checks it against torch
STORAGE_DTYPE_NAMES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "LongStorage": "int64",
    "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8", "QInt32Storage": "qint32", "QUInt8Storage": "quint8", "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}  # fmt: skip

if TYPE_CHECKING:
    import torch

    # the tables keyed by torch dtypes: built by ``__getattr__`` at first use, with torch
    SAFETENSORS_DTYPES: dict[torch.dtype, str]
    SAFETENSORS_TO_TORCH: dict[str, torch.dtype]
    SAFETENSORS_VALUES_PER_ELEMENT: dict[torch.dtype, int]
    UNCASTABLE_DTYPES: frozenset[torch.dtype]
    SUPPORTED_DTYPES: frozenset[torch.dtype]
    DTYPE_NAMES: dict[str, torch.dtype]


def __getattr__(name: str) -> Any:
    """The torch tables (``SAFETENSORS_DTYPES``, ``SUPPORTED_DTYPES``, ...), built with torch at first use."""
    if name not in _TORCH_TABLES:  # (the import system asks for __path__ and such: no torch for those)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _torch_tables()[name]


_TORCH_TABLES = frozenset(
    {
        "SAFETENSORS_DTYPES",
        "SAFETENSORS_TO_TORCH",
        "SAFETENSORS_VALUES_PER_ELEMENT",
        "UNCASTABLE_DTYPES",
        "SUPPORTED_DTYPES",
        "DTYPE_NAMES",
    }
)


def _torch_tables() -> dict[str, Any]:
    import torch

    _FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)  # torch >= 2.8

    # torch dtype -> safetensors dtype name (the header's "dtype"): dtypes.SAFETENSORS_NAMES keyed by torch dtypes
    SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
        getattr(torch, name): code for name, code in SAFETENSORS_NAMES.items() if hasattr(torch, name)
    }
    # safetensors dtype name -> torch dtype (the inverse of SAFETENSORS_DTYPES)
    SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
    # torch dtypes packing several safetensors values into one element: safetensors' header shape
    # counts the values (F4: two 4-bit floats per byte), so its last dim is this many times torch's
    SAFETENSORS_VALUES_PER_ELEMENT: dict[torch.dtype, int] = {
        getattr(torch, name): n for name, n in VALUES_PER_ELEMENT.items() if hasattr(torch, name)
    }

    # floating dtypes torch has no cast for (float4_e2m1fn_x2 packs two 4-bit values per element):
    # --dtype/--optim-dtype keep them as they are, and verify compares them by bytes only
    UNCASTABLE_DTYPES: frozenset[torch.dtype] = frozenset(getattr(torch, name) for name in UNCASTABLE if hasattr(torch, name))

    # dtypes a full tensor can be allocated, written by torch.save and read back for (no quantized types)
    SUPPORTED_DTYPES = frozenset(
        {
            torch.float64, torch.float32, torch.float16, torch.bfloat16,
            torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
            *([_FLOAT4] if _FLOAT4 is not None else []),
            torch.complex128, torch.complex64, torch.complex32,
            torch.int64, torch.int32, torch.int16, torch.int8,
            torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
        }
    )  # fmt: skip

    # dtypes.CAST_NAMES with torch dtypes: --dtype / --optim-dtype's names
    DTYPE_NAMES: dict[str, torch.dtype] = {name: getattr(torch, dtype) for name, dtype in CAST_NAMES.items()}

    tables = {
        "SAFETENSORS_DTYPES": SAFETENSORS_DTYPES,
        "SAFETENSORS_TO_TORCH": SAFETENSORS_TO_TORCH,
        "SAFETENSORS_VALUES_PER_ELEMENT": SAFETENSORS_VALUES_PER_ELEMENT,
        "UNCASTABLE_DTYPES": UNCASTABLE_DTYPES,
        "SUPPORTED_DTYPES": SUPPORTED_DTYPES,
        "DTYPE_NAMES": DTYPE_NAMES,
    }
    globals().update(tables)  # later lookups find them without this function
    return tables


def _values_per_element(dtype: torch.dtype | DType) -> int:
    return VALUES_PER_ELEMENT.get(str(dtype).removeprefix("torch."), 1)


def safetensors_shape(dtype: torch.dtype | DType, shape: tuple[int, ...]) -> list[int]:
    """The header ``shape`` safetensors writes for a torch tensor of ``dtype`` and ``shape`` (elements).

    The torch shape, except for packed dtypes (``SAFETENSORS_VALUES_PER_ELEMENT``), whose last dim
    counts safetensors values (``float4_e2m1fn_x2`` (3, 5) is ``F4`` [3, 10]).

    Raises:
        ValueError: a 0-dim tensor of a packed dtype (its header would count half a byte;
            safetensors itself refuses to write one).
    """
    per_element = _values_per_element(dtype)
    if per_element == 1:
        return list(shape)
    if not shape:
        raise ValueError(f"safetensors cannot hold a 0-dim {str(dtype).removeprefix('torch.')}")
    return [*shape[:-1], shape[-1] * per_element]


def torch_shape(dtype: torch.dtype | DType, header_shape: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape (elements) of a safetensors tensor whose header says ``dtype`` and ``header_shape``.

    The inverse of ``safetensors_shape``.

    Raises:
        ValueError: a packed dtype whose last dim does not fill whole torch elements (or no dims).
    """
    per_element = _values_per_element(dtype)
    if per_element == 1:
        return tuple(header_shape)
    if not header_shape or header_shape[-1] % per_element:
        # the header's shape is the file's: not quoted
        raise ValueError(f"its shape does not hold whole {str(dtype).removeprefix('torch.')} elements")
    return (*header_shape[:-1], header_shape[-1] // per_element)


# what the forkserver of torch's elastic launcher imports once (launch.run_workers across nodes or under torchrun)
WORKER_PRELOAD = ("torch.distributed", "fsdp_convert.ops.consolidate", "fsdp_convert.ops.reshard")
# a run stopped by a signal leaves the launcher's semaphore to multiprocessing's resource tracker,
# whose warning about it would be the only other line on stderr; and torch warns in every worker
# when NumPy is absent, which this tool never needs (it is not a dependency)
_WORKER_WARNING_FILTERS = ("ignore:resource_tracker:UserWarning", "ignore:Failed to initialize NumPy:UserWarning")


def quiet_workers(pythonwarnings: str) -> str:
    """``PYTHONWARNINGS`` for the forkserver and its workers: ``pythonwarnings`` plus the filters they need."""
    return ",".join(filter(None, [pythonwarnings, *(f for f in _WORKER_WARNING_FILTERS if f not in pythonwarnings)]))


# FSDP_CONVERT_READ_LOG=<folder>: every reader appends one JSON line per chunk it reads to
# <folder>/reads-<pid>.jsonl (which worker read what; the tests check the split of the reads)
READ_LOG_ENV = "FSDP_CONVERT_READ_LOG"
