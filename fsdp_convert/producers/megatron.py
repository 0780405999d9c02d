"""Megatron-Core's ``dist_checkpointing`` (``torch_dist``): how it is detected and how its own keys read.

Its DCP folder is keyed by sharded keys: model tensors at the top level (``embedding.*``,
``decoder.layers.*`` stacked on a leading layer dim), each optimizer tensor one flat key
``optimizer.state.<name>.<model key>``, beside ``common.pt`` (param groups, step, iteration) and
``metadata.json``. The record in ``producers.PRODUCERS`` holds these functions.
"""

from __future__ import annotations

import re

from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.formats.index import CheckpointIndex, Entry, ObjPath
from fsdp_convert.producers.detect import beside
from fsdp_convert.roles import EntryRole

__all__ = [
    "COMMON_FILENAME",
    "METADATA_FILENAME",
    "OPTIM_PREFIX",
    "check_optimizer",
    "detect",
    "entry_role",
    "optimizer_path",
]

COMMON_FILENAME = "common.pt"  # dist_checkpointing's common state: optimizer param_groups, step, iteration
METADATA_FILENAME = "metadata.json"  # dist_checkpointing's backend record ({"sharded_backend": "torch_dist", ...})
OPTIM_PREFIX = "optimizer.state."  # each optimizer tensor's flat key: optimizer.state.<name>.<model key>
# the distributed optimizer saved as dp_reshardable: whole flattened gradient buckets per DP rank
_BUCKET_RE = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.(gbuf_idx_|param_state)")

detect = beside(COMMON_FILENAME, METADATA_FILENAME)  # dist_checkpointing's files beside .metadata


def entry_role(entry: Entry) -> EntryRole | None:
    """The role of one of its flat keys: ``optimizer.state.<name>.<model key>`` is that parameter's state.

    Any other one-part key under ``optimizer.`` (the distributed optimizer's ``optimizer.distributed.…``
    buckets) is never a weight: ``other``. None for every other key (``roles.classify`` reads it).
    """
    top = entry.path[0]
    if len(entry.path) != 1 or not isinstance(top, str) or not top.startswith("optimizer."):
        return None
    name, _, param = top.removeprefix(OPTIM_PREFIX).partition(".")
    if top.startswith(OPTIM_PREFIX) and name and param:
        return EntryRole("optim_state", param=param, key=name)
    return EntryRole("other")


def optimizer_path(entry_path: ObjPath, path: ObjPath, keep_layout: bool) -> ObjPath | None:
    """Where an optimizer item read from one of its flat keys goes, as its loader has it; None for any other item.

    ``transform.build_items`` nests optimizer state under the entry's top-level key, which for one
    flat key is the whole key: ``path`` is ``(flat key, "state", model key, state name)``.
    ``consolidate`` puts it under ``optimizer`` (``{"state": {key: {name: tensor}}}``, as
    ``FP32Optimizer.sharded_state_dict`` builds it before keying by id), ``reshard``
    (``keep_layout``) back into one flat key, the model key renamed.
    """
    top = path[0]
    if entry_path != (top,) or not isinstance(top, str) or not top.startswith(OPTIM_PREFIX):
        return None
    _, _, key, name = path
    return (f"{OPTIM_PREFIX}{name}.{key}",) if keep_layout else ("optimizer", "state", key, name)


def check_optimizer(index: CheckpointIndex) -> None:
    """Refuse the distributed optimizer's ``dp_reshardable`` state, which is not per parameter.

    Raises:
        UnsupportedTransformError: an entry is one of its flattened buckets.
    """
    bucket = next((e.fqn for e in index.entries if _BUCKET_RE.match(e.fqn)), None)
    if bucket is not None:
        raise UnsupportedTransformError(
            f"{bucket}: Megatron's distributed optimizer saved as dp_reshardable (flattened buckets, not per "
            "parameter); save with distrib_optim_sharding_type fully_reshardable, or consolidate --only model"
        )
