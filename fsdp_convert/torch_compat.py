"""The one place that touches private torch names, so a torch upgrade changes one file.

Every private name is reached through a ``Feature``: a probe that finds it and checks it has
the shape this package relies on. A torch that lacks one fails with a one-line
``TorchFeatureError`` naming the torch version and the feature, at first use (and for every
feature at once by ``check_torch``, which the CLI runs before any command), never with an
``AttributeError`` from deep inside a conversion.

Covers: DCP's ``filesystem._StorageInfo`` (the per-chunk byte range in ``.metadata``) and
``metadata._MEM_FORMAT_ENCODING``, ``Metadata(version=...)``, ``torch._C.PyTorchFileWriter``
(torch.save's zip container writer, three-argument form with storage alignment, and its
``write_record_metadata``), ``torch.serialization._get_storage_alignment`` and the storage-type
names and rebuild functions torch.save's pickle uses.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import pickle
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from fsdp_convert.errors import TorchFeatureError

if TYPE_CHECKING:
    import torch

__all__ = [
    "TESTED_TORCH",
    "Feature",
    "FEATURES",
    "check_torch",
    "DCP_FEATURES",
    "StorageInfo",
    "MEM_FORMAT_ENCODING",
    "REBUILD_TENSOR_V2",
    "REBUILD_TENSOR_V3",
    "open_torch_save_writer",
    "storage_type_for",
    "storage_alignment",
    "reserve_record",
    "torch_layout",
]

TESTED_TORCH = ">=2.13,<2.15"  # pyproject.toml's range: the releases the whole suite passed on


@dataclasses.dataclass(frozen=True)
class Feature:
    """A private torch name this package uses, and a probe that finds it and checks its shape.

    Attributes:
        name: what the feature is, as the error message says it.
        probe: returns the object; raises ``AttributeError``, ``ImportError``, ``TypeError`` or
            ``ValueError`` where this torch lacks it or it has another shape.
    """

    name: str
    probe: Callable[[], Any]

    def get(self) -> Any:
        """The probed object.

        Raises:
            TorchFeatureError: this torch lacks the feature (one line: torch version, feature, tested range).
        """
        return _resolve(self)


@functools.cache
def _resolve(feature: Feature) -> Any:
    try:
        return feature.probe()
    except (AttributeError, ImportError, TypeError, ValueError) as e:
        import torch

        raise TorchFeatureError(
            f"torch {torch.__version__} lacks {feature.name} ({type(e).__name__}: {e}); "
            f"fsdp-convert is tested with torch{TESTED_TORCH}"
        ) from None


# torch.distributed.checkpoint (0.5 s to import) is imported by the probes that need it, not here:
# reading a checkpoint never does (formats/_dcp_records.py holds its own records of .metadata)


def _storage_info() -> type:
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    cls = dcp_filesystem._StorageInfo
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = {"relative_path", "offset", "length", "transform_descriptors"} - fields
    if missing:
        raise TypeError(f"_StorageInfo has no field(s) {sorted(missing)}")
    return cls


def _mem_format_encoding() -> type:
    import torch.distributed.checkpoint.metadata as dcp_metadata

    return dcp_metadata._MEM_FORMAT_ENCODING


def _metadata_version() -> type:
    import torch.distributed.checkpoint.metadata as dcp_metadata

    if "version" not in {f.name for f in dataclasses.fields(dcp_metadata.Metadata)}:
        raise TypeError("Metadata has no version field")
    return dcp_metadata.Metadata


def _torch_save_writer() -> type:
    import torch

    writer = torch._C.PyTorchFileWriter(io.BytesIO(), True, 64)  # three-argument form: storage alignment
    if not callable(getattr(writer, "write_record_metadata", None)):
        raise AttributeError("PyTorchFileWriter has no write_record_metadata")
    return type(writer)


def _storage_alignment() -> Callable[[], int]:
    import torch

    fn = torch.serialization._get_storage_alignment
    if not isinstance(fn(), int):
        raise TypeError("_get_storage_alignment does not return an int")
    return fn


def _storage_type_map() -> Callable[[], dict[torch.dtype, str]]:
    import torch

    fn = torch.storage._dtype_to_storage_type_map
    if fn().get(torch.float32) != "FloatStorage":
        raise ValueError("_dtype_to_storage_type_map()[float32] is not FloatStorage")
    return fn


def _rebuild(name: str, nargs: int) -> Callable[[], Callable[..., torch.Tensor]]:
    def probe() -> Callable[..., torch.Tensor]:
        import torch

        fn = getattr(torch._utils, name)
        if len(inspect.signature(fn).parameters) < nargs:
            raise TypeError(f"torch._utils.{name} takes fewer than {nargs} arguments")
        return fn  # type: ignore[no-any-return]

    return probe


FEATURES: dict[str, Feature] = {
    "storage_info": Feature("torch.distributed.checkpoint.filesystem._StorageInfo (with transform_descriptors)", _storage_info),
    "mem_format_encoding": Feature("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", _mem_format_encoding),
    "metadata_version": Feature("torch.distributed.checkpoint.metadata.Metadata(version=...)", _metadata_version),
    "torch_save_writer": Feature(
        "torch._C.PyTorchFileWriter(stream, compute_crc32, alignment) with write_record_metadata", _torch_save_writer
    ),
    "storage_alignment": Feature("torch.serialization._get_storage_alignment", _storage_alignment),
    "storage_type_map": Feature("torch.storage._dtype_to_storage_type_map", _storage_type_map),
    "rebuild_tensor_v2": Feature("torch._utils._rebuild_tensor_v2", _rebuild("_rebuild_tensor_v2", 6)),
    "rebuild_tensor_v3": Feature("torch._utils._rebuild_tensor_v3", _rebuild("_rebuild_tensor_v3", 7)),
}


# features only a command writing DCP's own records needs (writers/dcp.py); probing them imports
# torch.distributed.checkpoint
DCP_FEATURES = frozenset({"storage_info", "mem_format_encoding", "metadata_version"})


def check_torch(*, dcp: bool = True) -> None:
    """Probe every feature in ``FEATURES`` (the CLI runs this before any command that needs torch).

    Args:
        dcp: probe ``DCP_FEATURES`` too (they import ``torch.distributed.checkpoint``, ~0.5 s);
            a command that writes no DCP ``.metadata`` passes False.

    Raises:
        TorchFeatureError: the first feature this torch lacks.
    """
    for key, feature in FEATURES.items():
        if dcp or key not in DCP_FEATURES:
            feature.get()


def _or_none(key: str) -> Any:
    """A feature's object for a module-level name, or None where torch lacks it (``check_torch`` then says so)."""
    try:
        return FEATURES[key].get()
    except TorchFeatureError:
        return None


if TYPE_CHECKING:
    StorageInfo: Any
    MEM_FORMAT_ENCODING: Any
    REBUILD_TENSOR_V2: Any
    REBUILD_TENSOR_V3: Any


def __getattr__(name: str) -> Any:
    """``StorageInfo``, ``MEM_FORMAT_ENCODING`` (DCP's: imports it) and the rebuild functions, probed at first use.

    None where this torch lacks them (``check_torch`` then says so).
    """
    key = _LAZY.get(name)
    if key is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _or_none(key)


_LAZY = {
    "StorageInfo": "storage_info",
    "MEM_FORMAT_ENCODING": "mem_format_encoding",
    "REBUILD_TENSOR_V2": "rebuild_tensor_v2",
    "REBUILD_TENSOR_V3": "rebuild_tensor_v3",
}


def storage_alignment() -> int:
    """Byte alignment of storage records in torch.save zips (64 in torch 2.13), for mmap loads.

    Raises:
        TorchFeatureError: this torch has no ``_get_storage_alignment``.
    """
    return int(FEATURES["storage_alignment"].get()())


def open_torch_save_writer(stream: IO[bytes], *, compute_crc32: bool = True) -> torch._C.PyTorchFileWriter:
    """torch.save's own zip writer over ``stream``, with torch's storage alignment.

    Writing to a stream (not a path) makes the archive's folder name ``archive``, as
    ``torch.save(obj, buffer)`` does, so the bytes do not depend on the output's file name.
    With ``compute_crc32=False`` the records' CRC-32 fields are left 0 for the caller to fill.

    Raises:
        TorchFeatureError: this torch's writer takes no alignment or cannot reserve records.
    """
    import torch

    FEATURES["torch_save_writer"].get()
    return torch._C.PyTorchFileWriter(stream, compute_crc32, storage_alignment())


def reserve_record(writer: torch._C.PyTorchFileWriter, name: str, nbytes: int) -> None:
    """Write a record's zip headers and skip its ``nbytes`` of data, to be written in place later.

    ``PyTorchFileWriter.write_record_metadata``, what ``torch.serialization.skip_data`` uses;
    the stream must be seekable.

    Raises:
        TorchFeatureError: this torch's writer cannot reserve a record.
    """
    FEATURES["torch_save_writer"].get()
    writer.write_record_metadata(name, nbytes)  # type: ignore[attr-defined]


@functools.cache
def storage_type_for(dtype: torch.dtype) -> type | None:
    """The legacy typed-storage class torch.save pickles for ``dtype`` (e.g. ``torch.FloatStorage``).

    ``None`` for dtypes that have none (float8, uint16/32/64, ...): torch.save pickles those
    through ``torch.storage.UntypedStorage`` and ``torch._utils._rebuild_tensor_v3``.

    Raises:
        TorchFeatureError: this torch has no ``_dtype_to_storage_type_map``.
    """
    import torch

    name = FEATURES["storage_type_map"].get()().get(dtype)
    return None if name is None else getattr(torch, name)


def torch_layout(name: str) -> torch.layout:
    """The layout a pickle names, as ``torch.serialization._get_layout("torch.strided")`` answers, without importing it.

    Raises:
        pickle.UnpicklingError: ``name`` is not a torch layout.
    """
    import torch

    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return value


def stream_transform_from(descriptors: tuple[str, ...], stream: IO[bytes]) -> IO[bytes] | None:
    """``stream`` read back through DCP's stream transforms, as ``FileSystemReader`` undoes them.

    ``torch.distributed.checkpoint._extension.ExtensionRegistry().from_descriptor_list``, then each
    extension's ``transform_from`` in descriptor order (``filesystem._StorageReaderTransforms``);
    torch 2.13 registers ``ZStandard`` (``stream.zstd/1``, through the ``zstandard`` or ``pyzstd``
    package). The returned stream is not seekable.

    Returns:
        The decoding stream, or None where this torch has no extension registry (the caller then
        decodes what it knows itself).

    Raises:
        ValueError: a descriptor torch does not know, or whose decoder package is missing (torch's message).
    """
    try:
        from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
    except ImportError:
        return None
    registry = ExtensionRegistry()
    if not callable(getattr(registry, "from_descriptor_list", None)):
        return None
    for extension in registry.from_descriptor_list(list(descriptors)):
        if isinstance(extension, StreamTransformExtension):
            stream = extension.transform_from(stream)
    return stream


def dtensor_local_box(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[tuple[str, int, int], ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (sizes, offsets) DCP records for the local shard of a DTensor, in elements of the global tensor.

    torch's ``_compute_local_shape_and_global_offset`` on plain data (no mesh, no process group):
    what ``compute_local_shape_and_global_offset`` and so DCP's ``_create_chunk_from_dtensor``
    compute. Offsets are those of the shard's first element on each dim: a ``_StridedShard``
    shard whose elements are not contiguous still gets one box, so the caller checks that boxes tile.

    Args:
        shape: global shape.
        mesh_shape: size of each mesh dim.
        coordinate: this rank's place on each mesh dim.
        placements: per mesh dim ``(kind, dim, split_factor)``, kind ``"Shard"``,
            ``"_StridedShard"`` or ``"Replicate"`` (dim and split factor then unused).

    Raises:
        TorchFeatureError: this torch lacks the function or ``_StridedShard``.
    """
    import torch

    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as compute
        from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard
    except ImportError as e:
        raise TorchFeatureError(
            f"torch {torch.__version__} lacks torch.distributed.tensor._utils._compute_local_shape_and_global_offset "
            f"or _StridedShard ({e}); fsdp-convert is tested with torch{TESTED_TORCH}"
        ) from None
    made = [
        Shard(dim) if k == "Shard" else _StridedShard(dim, split_factor=sf) if k == "_StridedShard" else Replicate()
        for k, dim, sf in placements
    ]
    sizes, offsets = compute(shape, mesh_shape, list(coordinate), made)
    return tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)
