"""Roles stage: what each checkpoint entry is (model, optimizer state, param group field, other).

Pure functions over a ``CheckpointIndex``; no I/O. The layouts every producer shares are read
here; a producer's own key layout (Megatron-Core's flat optimizer keys) is a rule its record gives
(``producers.Producer.entry_role``, passed to ``classify``). Nesting paths back into a state dict
(``unflatten``) is the index's own (``formats/index.py``), so the writers need nothing from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from fsdp_convert.formats.index import CheckpointIndex, Entry, TensorEntry, dcp_key

__all__ = [
    "Group",
    "GROUPS",
    "Role",
    "EntryRole",
    "EntryRule",
    "NON_MODEL_TOPS",
    "group_of_top",
    "classify",
    "flat_layout",
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
class EntryRole:
    """What one checkpoint entry is, independent of how its producer nested it.

    Attributes:
        role: ``model`` (a weight or buffer), ``optim_state`` (one state value of one parameter),
            ``optim_group`` (one field of a param group), or ``other`` (scheduler, train state...).
        param: model FQN (``model``); the parameter's key in the optimizer state, an FQN or an id
            (``optim_state``); the parameter FQN of a per-parameter group field in torch's
            flattened optimizer state dict (``optim_group`` with ``group`` None).
        key: state name (``exp_avg``, ``step``) or param group field (``lr``, ``params``).
        group: param group index of an ``optim_group`` entry in the nested layout.
    """

    role: Role
    param: str | int | None = None
    key: str | None = None
    group: int | None = None

    @property
    def group_name(self) -> Group:
        """``model``, ``optim`` or ``other``."""
        return "model" if self.role == "model" else "optim" if self.role.startswith("optim") else "other"


def flat_layout(index: CheckpointIndex) -> bool:
    """Whether the weights sit at the top level (torchtitan; ``dcp.save(model.state_dict())``): no ``model`` key."""
    return all(e.path[0] != MODEL_TOP for e in index.entries)


# A producer's own key layout: an entry's role, or None where the shared layouts below read it.
EntryRule = Callable[[Entry], EntryRole | None]


def _classify_entry(entry: Entry, flat: bool, rules: Sequence[EntryRule]) -> EntryRole:
    for rule in rules:
        role = rule(entry)
        if role is not None:
            return role
    path = entry.path
    top = path[0]
    if top in OPTIM_TOPS and len(path) >= 2:
        second = path[1]
        if second == "state" and len(path) >= 4:
            return EntryRole("optim_state", param=path[2], key=dcp_key(path[3:]))
        if second == "param_groups" and len(path) == 4 and isinstance(path[2], int) and isinstance(path[3], str):
            return EntryRole("optim_group", key=path[3], group=path[2])
        if len(path) == 2 and isinstance(second, str):
            # torch's flattened optimizer state dict (flatten_optimizer_state_dict=True, torchtitan):
            # "state.<fqn>.<name>" and "param_groups.<fqn>.<field>"
            kind, _, rest = second.partition(".")
            fqn, _, name = rest.rpartition(".")
            if kind == "state" and fqn:
                return EntryRole("optim_state", param=fqn, key=name)
            if kind == "param_groups" and fqn:
                return EntryRole("optim_group", param=fqn, key=name)
        return EntryRole("other")
    if top == MODEL_TOP and len(path) >= 2:
        return EntryRole("model", param=dcp_key(path[1:]))
    if flat and top not in NON_MODEL_TOPS and isinstance(entry, TensorEntry):
        return EntryRole("model", param=dcp_key(path))
    return EntryRole("other")


def classify(index: CheckpointIndex, rules: Sequence[EntryRule]) -> tuple[EntryRole, ...]:
    """The ``EntryRole`` of every entry of ``index``, in order.

    Layouts understood: ``{"model": ..., "optim"|"optimizer": {"state": {param: {name: value}},
    "param_groups": [...]}}`` (FSDP2 ``get_state_dict``, FSDP1 ``FSDP.optim_state_dict``,
    accelerate, Lightning); model weights at the top level next to ``optimizer``,
    ``lr_scheduler``, ``train_state``, ``dataloader`` (torchtitan) with torch's flattened optimizer
    state dict (``StateDictOptions(flatten_optimizer_state_dict=True)``). Anything else is ``other``.

    Args:
        index: the checkpoint's index.
        rules: producers' own key layouts (``producers.entry_rules``: Megatron-Core's flat keys),
            asked first, in order; the first role one gives is the entry's.
    """
    flat = flat_layout(index)
    return tuple(_classify_entry(e, flat, rules) for e in index.entries)


def group_of_top(top: str | int) -> Group:
    """The group of a top-level state dict key (``model``, ``optim``/``optimizer``, anything else)."""
    if top == MODEL_TOP:
        return "model"
    if top in OPTIM_TOPS:
        return "optim"
    return "other"
