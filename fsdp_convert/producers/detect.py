"""How each producer is detected: predicates over a ``CheckpointIndex`` (nothing is read but file names).

The records in ``producers`` (``PRODUCERS``) hold these; ``detect_producer`` asks them in table order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.roles import flat_layout

__all__ = [
    "MEGATRON_COMMON_FILENAME",
    "MEGATRON_METADATA_FILENAME",
    "TORCHTUNE_PROGRESS",
    "any_dcp",
    "by_keys",
    "fsdp1",
    "fsdp_kind",
    "megatron",
    "named",
    "torchtitan",
    "torchtune",
    "wrapped",
]


def named(name: str) -> Callable[[CheckpointIndex], bool]:
    """Detection by the name the folder's files gave the index (``CheckpointIndex.producer``)."""

    def detect(index: CheckpointIndex) -> bool:
        return index.producer == name

    detect.__name__ = detect.__qualname__ = f"named_{name}"
    return detect


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
    """Detection by the key layout, for an index whose files name no producer."""

    def detect(index: CheckpointIndex) -> bool:
        return index.producer is None and not wrapped(index) and fsdp_kind(index) == kind

    detect.__name__ = detect.__qualname__ = f"by_keys_{kind}"
    return detect


def fsdp1(index: CheckpointIndex) -> bool:
    """FSDP1's wrapper names in the keys, or its sharded state dict's chunks (see ``fsdp_kind``)."""
    return index.producer is None and (wrapped(index) or fsdp_kind(index) == "fsdp1")


def torchtitan(index: CheckpointIndex) -> bool:
    """Model weights at the top level beside torchtitan's ``optimizer``/``train_state``/... keys."""
    tops = {e.path[0] for e in index.entries}
    return (
        index.producer is None and flat_layout(index) and bool(tops & {"optimizer", "train_state", "lr_scheduler", "dataloader"})
    )


# torchtune's TrainingProgress.state_dict() keys, saved beside "model" and "optimizer"
TORCHTUNE_PROGRESS = frozenset({"seed", "epochs_run", "total_epochs", "max_steps_per_epoch"})


def torchtune(index: CheckpointIndex) -> bool:
    """What torchtune's ``CheckpointClient`` saves: ``model`` beside its training progress keys (``epochs_run``...)."""
    tops = {e.path[0] for e in index.entries}
    return index.producer is None and "model" in tops and TORCHTUNE_PROGRESS <= tops


MEGATRON_COMMON_FILENAME = "common.pt"  # dist_checkpointing's common state: optimizer param_groups, step, iteration
MEGATRON_METADATA_FILENAME = "metadata.json"  # dist_checkpointing's backend record ({"sharded_backend": "torch_dist", ...})


def megatron(index: CheckpointIndex) -> bool:
    """Megatron-Core's ``dist_checkpointing`` files beside ``.metadata``: ``common.pt`` and ``metadata.json``."""
    root = index.checkpoint_id
    names = (MEGATRON_COMMON_FILENAME, MEGATRON_METADATA_FILENAME)
    return index.producer is None and isinstance(root, Path) and all((root / name).is_file() for name in names)


def any_dcp(index: CheckpointIndex) -> bool:
    """Any DCP checkpoint (the table's last record)."""
    return True
