"""The producer record: what one training stack's checkpoints are, and what each operation does with them.

``producers.PRODUCERS`` is the table of these records; every rule about a producer is a field of
its record (detection, optimizer key, files beside its data, folder layout, its own key layout),
and every other module asks the record.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from fsdp_convert.formats.index import CheckpointIndex, ObjPath
from fsdp_convert.own_files import OwnFiles
from fsdp_convert.roles import EntryRule

__all__ = ["Producer", "SideFile"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SideFile:
    """A kind of file beside a producer's DCP data (next to ``.metadata``, or to accelerate's folders).

    Attributes:
        pattern: matches the file's name (the whole name).
        action: ``copy``: ``reshard`` copies it byte for byte, never loaded (it holds the same at
            any world size); ``leave_out``: ``reshard`` leaves it out and says why.
        note: for ``leave_out``, why, after ``left out <names>: `` (the result's ``notes``).
    """

    pattern: re.Pattern[str]
    action: Literal["copy", "leave_out"]
    note: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Producer:
    """One training stack's checkpoints: how they are told apart and what each operation does with them.

    Attributes:
        name: what ``inspect`` prints (``producer: fsdp2``). Two records may share a name (FSDP1's
            DCP folder and its rank files); ``get`` gives the first.
        detect: whether an index is this producer's, from the facts its format recorded
            (``CheckpointIndex.folders``, ``beside``, ``marks``, the data file names) or, with
            ``by_keys``, from its key layout; never a file's contents.
        by_keys: ``detect`` reads the key layout: asked only when no record detects the index
            from its files. Within each kind, the first record of ``PRODUCERS`` that detects it
            names the checkpoint.
        optimizer_key: the top-level key its optimizer state sits under (``consolidate``'s
            ``--layout producer`` keeps it, ``nested`` writes ``optim``).
        side_files: the files beside its DCP data that ``reshard`` copies or leaves out; any other
            file is left out as unknown. Those it copies are this tool's own in an output
            (``producers.own_files``: ``--overwrite`` replaces them without ``--force``).
        merged: a ``torch.save`` file beside ``.metadata`` whose entries ``consolidate`` merges at the
            top level in the producer's layout, as the producer's own loader does (Lightning's
            ``meta.pt``); None for none. A symbolic link out of the folder is refused once the
            producer is detected, as every file of the checkpoint is (``location.inside``).
        folders: the DCP folders side by side that make one checkpoint (accelerate's
            ``pytorch_model_fsdp_<n>/`` and ``optimizer_<n>/``); ``reshard`` writes each as a DCP
            folder again. None: the checkpoint is one DCP folder.
        written: the names ``reshard`` writes where it writes the producer's own save format rather
            than DCP (DeepSpeed's ``latest`` and tag folder): this tool's own in an output, as
            ``side_files`` it copies are.
        params_in_model_order: ``--optim-keys ids`` numbers each group's params in the model's
            order (FSDP1's ``optim_state_dict`` keeps no param group order of its own).
        flat_optimizer: ``consolidate``'s ``--layout producer`` keeps a flattened optimizer state dict
            as saved, as OLMo-core's ``unshard_checkpoint`` does; ``nested`` rebuilds it.
        stacked_layers: the FQN prefix of the model tensors it stacks on a leading layer dim
            (Megatron-Core's ``decoder.layers.``), which ``--unstack-layers`` splits per layer;
            empty: none (the flag is refused).
        entry_role: its own key layout, where ``roles.classify``'s shared layouts would misread it:
            an entry's role, or None (Megatron-Core's flat ``optimizer.state.<name>.<key>``). Asked
            of every checkpoint (a remote folder's producer cannot be told from its files), so it
            recognises only keys no other producer writes.
        optimizer_path: where an optimizer item read from one of its own keys goes:
            ``(entry path, item path, keep_layout) -> item path``, None for an item it leaves as
            built (``plan.items.prepare_items``; asked of every checkpoint, as ``entry_role``).
        check_optimizer: raises ``UnsupportedTransformError`` for optimizer state of its own that
            cannot be put per parameter, before a consolidation with the optimizer reads anything.
        label: the table's first column (Markdown).
        on_disk: the table's "what is on disk" column (Markdown); empty: no row in the table.
        notes: the table's "notes" column (Markdown).
        tested: the table's "tested with" column: the writer's version whose own save (and load) the
            tests run (Markdown).
        consolidate_loader: what reads ``consolidate``'s default output (Markdown).
        reshard_loader: what reads ``reshard --world-size M``'s output (Markdown).
    """

    name: str
    detect: Callable[[CheckpointIndex], bool]
    by_keys: bool = False
    optimizer_key: str = "optim"
    side_files: tuple[SideFile, ...] = ()
    merged: str | None = None
    folders: re.Pattern[str] | None = None
    written: OwnFiles = OwnFiles()
    params_in_model_order: bool = False
    flat_optimizer: bool = False
    stacked_layers: str = ""
    entry_role: EntryRule | None = None
    optimizer_path: Callable[[ObjPath, ObjPath, bool], ObjPath | None] | None = None
    check_optimizer: Callable[[CheckpointIndex], None] | None = None
    label: str = ""
    on_disk: str = ""
    notes: str = ""
    tested: str = ""
    consolidate_loader: str = ""
    reshard_loader: str = ""

    def side_file(self, name: str) -> SideFile | None:
        """The first of ``side_files`` whose pattern matches the file name ``name``, or None."""
        return next((s for s in self.side_files if s.pattern.fullmatch(name)), None)
