"""How each producer is detected: predicates over a ``CheckpointIndex`` (the facts its format recorded, and its keys).

The records in ``producers`` (``PRODUCERS``) hold these. A format records what it saw and names
no producer (``CheckpointIndex.folders``, ``beside``, ``marks``); ``detect_producer`` asks the
records that read those facts first (``Producer.by_keys`` false), then those that read the key
layout. Nothing is read but the index (OLMo-core's step folder passed by its ``model_and_optim/``:
one look at the name beside it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fsdp_convert.formats.dcp import ACCELERATE_DIR_RE, OLMO_CORE_DIRNAME
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.roles import flat_layout

__all__ = [
    "LIGHTNING_META_FILENAME",
    "OLMO_CORE_METADATA_FILENAME",
    "TORCHTUNE_PROGRESS",
    "accelerate",
    "any_dcp",
    "beside",
    "by_keys",
    "fsdp1",
    "fsdp1_rank_files",
    "fsdp_kind",
    "hf_storage",
    "lightning",
    "olmo_core",
    "safetensors",
    "torch_save",
    "torchtitan",
    "torchtune",
    "verl",
    "wrapped",
]

LIGHTNING_META_FILENAME = "meta.pt"  # Lightning Fabric's FSDP strategy: user metadata beside .metadata
OLMO_CORE_METADATA_FILENAME = ".metadata.json"  # OLMo-core's stepN/: beside model_and_optim/, train/, config.json


# --- by the files: what the format saw beside and in the data ---


def beside(*names: str) -> Callable[[CheckpointIndex], bool]:
    """Detection by files beside a DCP folder's ``.metadata`` (``CheckpointIndex.beside``), all of ``names``."""

    def detect(index: CheckpointIndex) -> bool:
        return not index.folders and all(name in index.beside for name in names)

    detect.__name__ = detect.__qualname__ = f"beside_{'_'.join(names)}"
    return detect


def accelerate(index: CheckpointIndex) -> bool:
    """The folder of accelerate's ``save_state``: DCP folders ``pytorch_model_fsdp_<n>/`` and ``optimizer_<n>/`` side by side."""
    return bool(index.folders) and all(ACCELERATE_DIR_RE.fullmatch(name) for name in index.folders)


def lightning(index: CheckpointIndex) -> bool:
    """Lightning Fabric's ``meta.pt`` beside ``.metadata``."""
    return not index.folders and LIGHTNING_META_FILENAME in index.beside


def olmo_core(index: CheckpointIndex) -> bool:
    """OLMo-core's ``stepN/`` (its ``model_and_optim/`` DCP folder), or that folder passed alone beside ``.metadata.json``."""
    if index.folders == (OLMO_CORE_DIRNAME,):
        return True
    root = index.checkpoint_id
    return (
        not index.folders
        and not index.marks
        and isinstance(root, Path)
        and root.name == OLMO_CORE_DIRNAME
        and (root.parent / OLMO_CORE_METADATA_FILENAME).is_file()
    )


def hf_storage(index: CheckpointIndex) -> bool:
    """Safetensors files of torch's ``HuggingFaceStorageWriter``, whose headers carry ``DCP_SHARDING_INFO``."""
    return {"safetensors", "dcp_sharding_info"} <= index.marks


def safetensors(index: CheckpointIndex) -> bool:
    """Safetensors files read as DCP chunks without sharding info: whole tensors."""
    return "safetensors" in index.marks and "dcp_sharding_info" not in index.marks


def fsdp1_rank_files(index: CheckpointIndex) -> bool:
    """FSDP1's ``SHARDED_STATE_DICT`` saved rank by rank with ``torch.save``: rank files holding ``ShardedTensor`` values."""
    return {"rank_files", "sharded_tensor"} <= index.marks


def verl(index: CheckpointIndex) -> bool:
    """The rank files verl writes (``model_world_size_<N>_rank_<r>.pt``...), holding no ``ShardedTensor``."""
    marks = index.marks
    return "rank_files" in marks and "sharded_tensor" not in marks and any("_world_size_" in f for f in index.data_files)


def deepspeed(index: CheckpointIndex) -> bool:
    """A DeepSpeed ZeRO save (``formats/deepspeed.py`` marks it)."""
    return "deepspeed" in index.marks


def torch_save(index: CheckpointIndex) -> bool:
    """Any per-rank torch.save files."""
    return "rank_files" in index.marks


# --- by the keys: for an index whose files name no producer ---


def wrapped(index: CheckpointIndex) -> bool:
    """Keys carry FSDP1's wrapper names (``_fsdp_wrapped_module``, ``_flat_param``)."""
    return any("_fsdp_wrapped_module" in e.fqn or "_flat_param" in e.fqn for e in index.entries)


def fsdp_kind(index: CheckpointIndex) -> str:
    """``fsdp2``, ``fsdp1`` or ``fsdp`` for the ``{"model", "optim"}`` layout with FQN-keyed optimizer state; else ``dcp``.

    FSDP2 records an empty chunk for each rank past the end of a small tensor; FSDP1's sharded
    state dict leaves them out. With no tensor smaller than the world size, the layouts agree.
    """
    tops = {e.path[0] for e in index.entries}
    optim_fqn_keyed = any(
        len(e.path) >= 4 and e.path[:2] == ("optim", "state") and isinstance(e.path[2], str) for e in index.entries
    )
    if not ({"model", "optim"} <= tops and optim_fqn_keyed) or index.world_size < 2:
        return "dcp"
    small = [e for e in index.tensors() if e.shape and e.shape[0] < index.world_size]
    if any(c.numel == 0 for e in small for c in e.chunks):
        return "fsdp2"
    return "fsdp1" if small else "fsdp"


def by_keys(kind: str) -> Callable[[CheckpointIndex], bool]:
    """Detection by the key layout (``fsdp_kind``), without FSDP1's wrapper names."""

    def detect(index: CheckpointIndex) -> bool:
        return not wrapped(index) and fsdp_kind(index) == kind

    detect.__name__ = detect.__qualname__ = f"by_keys_{kind}"
    return detect


def fsdp1(index: CheckpointIndex) -> bool:
    """FSDP1's wrapper names in the keys, or its sharded state dict's chunks (see ``fsdp_kind``)."""
    return wrapped(index) or fsdp_kind(index) == "fsdp1"


def torchtitan(index: CheckpointIndex) -> bool:
    """Model weights at the top level beside torchtitan's ``optimizer``/``train_state``/... keys."""
    tops = {e.path[0] for e in index.entries}
    return flat_layout(index) and bool(tops & {"optimizer", "train_state", "lr_scheduler", "dataloader"})


# torchtune's TrainingProgress.state_dict() keys, saved beside "model" and "optimizer"
TORCHTUNE_PROGRESS = frozenset({"seed", "epochs_run", "total_epochs", "max_steps_per_epoch"})


def torchtune(index: CheckpointIndex) -> bool:
    """What torchtune's ``CheckpointClient`` saves: ``model`` beside its training progress keys (``epochs_run``...)."""
    tops = {e.path[0] for e in index.entries}
    return "model" in tops and TORCHTUNE_PROGRESS <= tops


def any_dcp(index: CheckpointIndex) -> bool:
    """Any DCP checkpoint (the table's last record)."""
    return True
