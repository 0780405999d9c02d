"""Index stage, shared: the classes a rank file or a DeepSpeed file pickles, as inert records (no torch import).

A per-rank file's pickle names DTensor, DeviceMesh, ShardedTensor and their placements and
metadata; a DeepSpeed file's names DeepSpeed's loss scaler, ZeRO stage and fragment address.
Each becomes a ``Record`` of its own kind holding its pickled arguments and state, never the real
class: ``_rank_unpickler`` (torch's loader) and ``_ds_records`` (no torch) make the same records.
"""

from __future__ import annotations

from typing import Any

from fsdp_convert.formats.index import ObjPath

__all__ = ["BuildsRecords", "Record", "SHARDED_TENSOR", "kind", "local_value", "record_classes"]


class Record:
    """What a pickled DTensor, DeviceMesh, ShardedTensor or placement becomes.

    It keeps the pickled arguments and state and never runs anything: no process group and no
    mesh is made, whatever the file says.
    """

    qualname = "?"
    args: tuple[Any, ...]
    state: Any
    newobj = False  # made by NEWOBJ (``cls.__new__``), not called (REDUCE)

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @classmethod
    def made_by_newobj(cls, args: tuple[Any, ...]) -> Record:
        """NEWOBJ of this record class, as an unpickler's ``new`` makes it (a fresh record, marked so)."""
        obj = cls.__new__(cls, *args)
        obj.newobj = True
        return obj

    @property
    def fields(self) -> dict[str, Any]:
        """The BUILD state as one dict (a dict, or ``(dict | None, slots)``); another tuple as ``__tuple_state__``."""
        state = self.state
        if state is None:
            return {}
        if isinstance(state, dict):
            return state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and state[0] in (None, {}):
            return {**(state[0] or {}), **state[1]}
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict) and state[1] is None:
            return state[0]
        return {"__tuple_state__": state}

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


class BuildsRecords:
    """An unpickler mixin (before its ``SafeUnpickler`` base): BUILD sets a ``Record``'s state, anything else is the base's.

    Only the unpickler's own ``call`` and ``new`` make a record, fresh in its load.
    """

    def build(self, obj: Any, state: Any) -> None:
        if isinstance(obj, Record):
            obj.__setstate__(state)
        else:
            super().build(obj, state)  # type: ignore[misc]


# Classes a rank file of DTensors or ShardedTensors names, each read as a Record of its own kind.
_RECORD_NAMES = (
    "torch.distributed.tensor._api.DTensor",
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed.device_mesh._DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
    "torch.distributed.tensor.placement_types.Shard",
    "torch.distributed.tensor.placement_types.Replicate",
    "torch.distributed.tensor.placement_types.Partial",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor",
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState",
    "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
    "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
    "torch.distributed._shard.sharded_tensor.shard.Shard",
    "torch.distributed._shard.metadata.ShardMetadata",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
    "torch.distributed._shard.sharding_spec.api.EnumerableShardingSpec",
    "torch.distributed.remote_device._remote_device",
)


def record_classes(names: tuple[str, ...]) -> dict[str, type[Record]]:
    """One ``Record`` class per pickled class name (``module.Qualname``): what ``load_rank_file`` makes of each, inert."""
    return {name: type(name.rsplit(".", 1)[-1], (Record,), {"qualname": name}) for name in names}


_RECORDS: dict[str, type[Record]] = record_classes(_RECORD_NAMES)
SHARDED_TENSOR = _RECORDS["torch.distributed._shard.sharded_tensor.api.ShardedTensor"]


def kind(obj: Any) -> str:
    """The class name a Record stands for (``DTensor``, ``Shard``...), or ``""``."""
    return obj.qualname.rsplit(".", 1)[-1] if isinstance(obj, Record) else ""


def local_value(obj: Any, record: ObjPath) -> Any:
    """The value a chunk's or value's ``record`` names in a loaded rank file.

    ``record`` is the path in the nested dict, then ``_local_tensor`` for a DTensor or
    ``("local_shards", i)`` for a ShardedTensor.

    Raises:
        KeyError, IndexError: the record is not in the file (it changed since it was indexed).
    """
    for i, key in enumerate(record):
        if key == "_local_tensor" and i == len(record) - 1 and kind(obj) == "DTensor":
            return obj.fields["_local_tensor"]
        if key == "local_shards" and i == len(record) - 2 and obj.__class__ is SHARDED_TENSOR:
            return obj.fields["__tuple_state__"][0][record[i + 1]].fields["tensor"]
        obj = obj[key]
    return obj
