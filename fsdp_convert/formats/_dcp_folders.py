"""Index stage, DCP: folders that hold DCP folders (accelerate's, OLMo-core's, torchtune's), read as one checkpoint.

A folder without ``.metadata`` may still be one checkpoint. accelerate's FSDP checkpoint folder
(``pytorch_model_fsdp_0/`` + ``optimizer_0/``, two DCP folders side by side) and OLMo-core's
``stepN/`` (its ``model_and_optim/``) are read as one index whose data file names carry their
subfolder (``merge_indexes``); torchtune's ``output/`` as its newest ``dist_epoch_<n>/``. Any
other folder of checkpoints is refused with a message naming the one to pass.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from fsdp_convert.errors import NotADcpCheckpointError
from fsdp_convert.formats.deepspeed_files import deepspeed_tags
from fsdp_convert.formats.index import CheckpointIndex, Entry, Location, TensorEntry
from fsdp_convert.held_roots import inside
from fsdp_convert.output_table import METADATA_FILENAME

__all__ = ["ACCELERATE_DIR_RE", "OLMO_CORE_DIRNAME", "metadata_subfolders", "dcp_folders_in", "merge_indexes"]

# accelerate's FSDP checkpoint folder: one DCP folder for the model, one per optimizer
ACCELERATE_DIR_RE = re.compile(r"(pytorch_model_fsdp|optimizer)_\d+")
OLMO_CORE_DIRNAME = "model_and_optim"  # OLMo-core's stepN/: its DCP folder, beside train/ and config.json
# torchtune's DistributedCheckpointer: output/dist_epoch_<n>/, one DCP folder per epoch
_TORCHTUNE_DIR_RE = re.compile(r"dist_epoch_(\d+)")

logger = logging.getLogger(__name__)


def metadata_subfolders(root: Path) -> list[Path]:
    """The folders directly in ``root`` that hold a ``.metadata`` (checkpoints one level down), sorted.

    Raises:
        NotADcpCheckpointError: ``root`` cannot be listed.
    """
    try:
        return sorted(d for d in root.iterdir() if (d / METADATA_FILENAME).is_file())
    except OSError as e:
        raise NotADcpCheckpointError(f"{root} cannot be listed ({e.strerror})") from e


def dcp_folders_in(root: Path) -> list[Path] | Path:
    """The DCP folders that make up the checkpoint at ``root``, a folder without ``.metadata``.

    Returns:
        A list of folders to read as one checkpoint (``merge_indexes``): accelerate's parts, or
        OLMo-core's ``model_and_optim/``. Or one folder that is the checkpoint itself: torchtune's
        newest ``dist_epoch_<n>/`` (checked to lie inside ``root``, ``location.inside``).

    Raises:
        NotADcpCheckpointError: none of these; the message names the folder to pass when ``root``
            holds checkpoints (one, several: the newest, or OLMo-core's ``stepN/`` folders). Two
            torchtune folders of the newest epoch.
        UnsafeContentError: torchtune's newest ``.metadata`` is a symbolic link out of ``root``.
    """
    subs = metadata_subfolders(root)
    parts = [d for d in subs if ACCELERATE_DIR_RE.fullmatch(d.name)]
    if parts:
        return parts
    if (root / OLMO_CORE_DIRNAME / METADATA_FILENAME).is_file():  # read as one checkpoint, as accelerate's
        return [root / OLMO_CORE_DIRNAME]
    newest = _newest_torchtune_epoch(root, subs)
    if newest is not None:
        logger.info("%s: reading %s, the newest dist_epoch_<n> (the one torchtune resumes from)", root, newest.name)
        inside(root, newest / METADATA_FILENAME)
        return newest
    if not subs:  # OLMo-core's save folder: stepN/ folders, each a checkpoint (its DCP folder one level down)
        subs = sorted(d.parent for d in root.glob(f"*/{OLMO_CORE_DIRNAME}") if (d / METADATA_FILENAME).is_file())
    if not subs:  # DeepSpeed's save folder without ``latest``: its tag folders
        subs = deepspeed_tags(root)
    if len(subs) == 1:
        raise NotADcpCheckpointError(f"{root} has no {METADATA_FILENAME}, but {subs[0]} has: pass that folder")
    if subs:
        newest = max(subs, key=lambda d: (len(d.name), d.name))  # step-10 after step-9
        names = ", ".join(d.name for d in subs[:5]) + (", ..." if len(subs) > 5 else "")
        raise NotADcpCheckpointError(
            f"{root} has no {METADATA_FILENAME}; it holds {len(subs)} checkpoints ({names}): pass one, e.g. {newest}"
        )
    raise NotADcpCheckpointError(f"{root} has no {METADATA_FILENAME}; not a DCP checkpoint")


def _newest_torchtune_epoch(root: Path, subs: list[Path]) -> Path | None:
    """The ``dist_epoch_<n>/`` of the largest ``n`` in torchtune's ``output/``; None unless all its DCP folders are such.

    The folder torchtune's ``DistributedCheckpointer._get_latest_intermediate_checkpoint`` resumes from.

    Raises:
        NotADcpCheckpointError: two folders are of that epoch (``dist_epoch_2``, ``dist_epoch_02``).
    """
    epochs = {d: int(m.group(1)) for d in subs if (m := _TORCHTUNE_DIR_RE.fullmatch(d.name))}
    if not epochs or len(epochs) != len(subs):
        return None
    last = max(epochs.values())
    newest = [d for d, n in epochs.items() if n == last]
    if len(newest) > 1:
        names = ", ".join(d.name for d in newest)
        raise NotADcpCheckpointError(f"{root} has no {METADATA_FILENAME}; its newest epoch {last} is in {names}: pass one")
    return newest[0]


def merge_indexes(root: Path, parts: list[CheckpointIndex]) -> CheckpointIndex:
    """One index over several DCP folders inside ``root`` (its ``folders``); data file paths become relative to ``root``.

    Raises:
        NotADcpCheckpointError: two folders hold the same key.
    """
    entries: list[Entry] = []
    owner: dict[str, Location] = {}
    files: list[str] = []
    for part in parts:
        prefix = part.checkpoint_id.name
        for e in part.entries:
            if e.fqn in owner:
                raise NotADcpCheckpointError(f"{e.fqn} is in both {owner[e.fqn]} and {part.checkpoint_id}")
            owner[e.fqn] = part.checkpoint_id
            if isinstance(e, TensorEntry):
                chunks = tuple(
                    c if c.relative_path is None else dataclasses.replace(c, relative_path=f"{prefix}/{c.relative_path}")
                    for c in e.chunks
                )
                entries.append(dataclasses.replace(e, chunks=chunks))
            else:
                entries.append(dataclasses.replace(e, relative_path=f"{prefix}/{e.relative_path}"))
        files += [f"{prefix}/{f}" for f in part.data_files]
    return CheckpointIndex(
        checkpoint_id=root,
        entries=tuple(entries),
        data_files=tuple(sorted(files)),
        version=parts[0].version,
        save_id=parts[0].save_id,
        folders=tuple(sorted(part.checkpoint_id.name for part in parts)),
    )
