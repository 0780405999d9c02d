"""Layout stage: which producer wrote a checkpoint and how its entries group (model, optimizer, other).

Pure functions over a ``CheckpointIndex``; no I/O. Nesting paths back into a state dict
(``unflatten``) is the index's own (``formats/index.py``), so the writers need nothing from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp_convert.formats.index import CheckpointIndex, Entry, TensorEntry, dcp_key

__all__ = [
    "Group",
    "GROUPS",
    "Role",
    "Slot",
    "NON_MODEL_TOPS",
    "group_of_top",
    "classify",
    "detect_producer",
    "dcp_key",  # re-exported from formats.index
]

Group = Literal["model", "optim", "other"]
GROUPS: tuple[Group, ...] = ("model", "optim", "other")
Role = Literal["model", "optim_state", "optim_group", "other"]

MODEL_TOP = "model"
OPTIM_TOPS = ("optim", "optimizer")
# Top-level keys that are never model weights in a checkpoint whose weights sit at the top level
# (torchtitan's checkpoint.py: optimizer, lr_scheduler, train_state, dataloader; others' extras).
NON_MODEL_TOPS = frozenset(
    {*OPTIM_TOPS, "lr_scheduler", "lr_schedulers", "scheduler", "train_state", "dataloader", "extra_state", "rng_state"}
)


@dataclass(frozen=True, slots=True)
class Slot:
    """What one checkpoint entry is, independent of how its producer nested it.

    Attributes:
        role: ``model`` (a weight or buffer), ``optim_state`` (one state value of one parameter),
            ``optim_group`` (one field of a param group), or ``other`` (scheduler, train state...).
        param: model FQN (``model``); the parameter's key in the optimizer state, an FQN or an id
            (``optim_state``); the parameter FQN of a per-parameter group field in torch's
            flattened optimizer state dict (``optim_group`` with ``group`` None).
        key: state name (``exp_avg``, ``step``) or param group field (``lr``, ``params``).
        group: param group index of an ``optim_group`` slot in the nested layout.
    """

    role: Role
    param: str | int | None = None
    key: str | None = None
    group: int | None = None

    @property
    def group_name(self) -> Group:
        """``model``, ``optim`` or ``other``."""
        return "model" if self.role == "model" else "optim" if self.role.startswith("optim") else "other"


def _flat_layout(index: CheckpointIndex) -> bool:
    """Weights at the top level (torchtitan; ``dcp.save(model.state_dict())``): no ``model`` key."""
    return all(e.path[0] != MODEL_TOP for e in index.entries)


def _classify_entry(entry: Entry, flat: bool) -> Slot:
    path = entry.path
    top = path[0]
    if top in OPTIM_TOPS and len(path) >= 2:
        second = path[1]
        if second == "state" and len(path) >= 4:
            return Slot("optim_state", param=path[2], key=dcp_key(path[3:]))
        if second == "param_groups" and len(path) == 4 and isinstance(path[2], int) and isinstance(path[3], str):
            return Slot("optim_group", key=path[3], group=path[2])
        if len(path) == 2 and isinstance(second, str):
            # torch's flattened optimizer state dict (flatten_optimizer_state_dict=True, torchtitan):
            # "state.<fqn>.<name>" and "param_groups.<fqn>.<field>"
            kind, _, rest = second.partition(".")
            fqn, _, name = rest.rpartition(".")
            if kind == "state" and fqn:
                return Slot("optim_state", param=fqn, key=name)
            if kind == "param_groups" and fqn:
                return Slot("optim_group", param=fqn, key=name)
        return Slot("other")
    if top == MODEL_TOP and len(path) >= 2:
        return Slot("model", param=dcp_key(path[1:]))
    if flat and top not in NON_MODEL_TOPS and isinstance(entry, TensorEntry):
        return Slot("model", param=dcp_key(path))
    return Slot("other")


def classify(index: CheckpointIndex) -> tuple[Slot, ...]:
    """The ``Slot`` of every entry of ``index``, in order.

    Layouts understood: ``{"model": ..., "optim"|"optimizer": {"state": {param: {name: value}},
    "param_groups": [...]}}`` (FSDP2 ``get_state_dict``, FSDP1 ``FSDP.optim_state_dict``,
    accelerate, Lightning); model weights at the top level next to ``optimizer``,
    ``lr_scheduler``, ``train_state``, ``dataloader`` (torchtitan) with torch's flattened optimizer
    state dict (``StateDictOptions(flatten_optimizer_state_dict=True)``). Anything else is ``other``.
    """
    flat = _flat_layout(index)
    return tuple(_classify_entry(e, flat) for e in index.entries)


def group_of_top(top: str | int) -> Group:
    """The group of a top-level state dict key (``model``, ``optim``/``optimizer``, anything else)."""
    if top == MODEL_TOP:
        return "model"
    if top in OPTIM_TOPS:
        return "optim"
    return "other"


def detect_producer(index: CheckpointIndex) -> str:
    """Name the training stack that wrote the checkpoint, from its files and key layout.

    Returns:
        ``"accelerate"`` or ``"lightning"`` when the folder says so (``read_index`` records it:
        accelerate's ``pytorch_model_fsdp_0/`` + ``optimizer_0/``, Lightning's ``meta.pt``);
        ``"fsdp1"`` when keys carry FSDP1 wrapper names (``_fsdp_wrapped_module``, ``_flat_param``);
        ``"torchtitan"`` for model weights at the top level beside ``optimizer``/``train_state``;
        ``"fsdp2"`` or ``"fsdp1"`` for the ``{"model", "optim"}`` layout with FQN-keyed optimizer
        state (FSDP2 ``get_state_dict``, FSDP1 ``SHARDED_STATE_DICT`` + ``FSDP.optim_state_dict``),
        told apart by the empty chunks FSDP2 records for small tensors; ``"fsdp"`` when no tensor
        is small enough to tell; ``"dcp"`` for any other DCP checkpoint.
    """
    if index.producer is not None:
        return index.producer
    fqns = [e.fqn for e in index.entries]
    if any("_fsdp_wrapped_module" in f or "_flat_param" in f for f in fqns):
        return "fsdp1"
    tops = {e.path[0] for e in index.entries}
    if _flat_layout(index) and tops & {"optimizer", "train_state", "lr_scheduler", "dataloader"}:
        return "torchtitan"
    optim_fqn_keyed = any(
        len(e.path) >= 4 and e.path[:2] == ("optim", "state") and isinstance(e.path[2], str) for e in index.entries
    )
    if not ({"model", "optim"} <= tops and optim_fqn_keyed) or index.world_size < 2:
        return "dcp"
    # FSDP2 records an empty chunk for each rank past the end of a small tensor; FSDP1's sharded
    # state dict leaves them out. With no tensor smaller than the world size, the layouts agree.
    small = [e for e in index.tensors() if e.shape and e.shape[0] < index.world_size]
    if any(c.numel == 0 for e in small for c in e.chunks):
        return "fsdp2"
    return "fsdp1" if small else "fsdp"
