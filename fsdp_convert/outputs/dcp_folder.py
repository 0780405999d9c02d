"""Output kinds, ``reshard``'s: ``DcpFolder``, a DCP folder for a target world size (``output_table.DCP_ROW``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.formats.index import ObjPath, dcp_key, plain_path, readable_name, readable_path
from fsdp_convert.held_roots import open_inside
from fsdp_convert.output_table import DCP_ROW
from fsdp_convert.outputs.kind import RowKind
from fsdp_convert.roles import GROUPS, Group
from fsdp_convert.writers.dcp import MetadataEntry, StoredChunk, compress_data_files, write_metadata

__all__ = ["DcpFolder"]


@dataclass(frozen=True, slots=True)
class DcpFolder(RowKind):
    """``reshard``'s output kind: a DCP folder for the target world size (accelerate's: a folder of them).

    Its name, folder flag and ``.metadata`` last come from its row (``outputs.Output``'s members);
    its files are laid out by ``plan.reshard`` and written by the workers
    (``ops/_reshard_rank.py``); rank 0's process then finishes each DCP folder
    (``finish_metadata``: its ``.metadata``, last) and the output folder (``finish_folder``: the
    producer's files beside, copied).
    """

    row = DCP_ROW

    def groups(self, only: str = "all") -> tuple[Group, ...]:
        """Every group (``model``, ``optim``, ``other``), whatever ``only``: a resharded checkpoint keeps all its state."""
        return GROUPS

    def check_keys(self, paths: Iterable[ObjPath]) -> None:
        """Refuse, before anything is written, a key the DCP reader refuses (``formats.index.readable_name``).

        A ``.pt`` source may key its dicts with any string; ``.metadata`` written with a newline,
        NUL or lone surrogate in a key would load in torch but not in this tool's own ``inspect``
        and ``verify``, which check a key prints on one line.

        Args:
            paths: every output entry's path in the nested state dict.

        Raises:
            UnsupportedTransformError: naming the first such key, escaped.
        """
        for path in paths:
            key = dcp_key(path)
            if not readable_name(key) or not readable_path(plain_path(path)):
                raise UnsupportedTransformError(
                    f"{key!r}: a key a DCP folder cannot hold (not a printable string: a newline, NUL, control "
                    "character or lone surrogate); rename it in the source, or consolidate to a .pt, which holds any key"
                )

    def finish_metadata(
        self,
        folder: Path,
        entries: Sequence[MetadataEntry],
        stored: Sequence[StoredChunk],
        version: str | None,
        *,
        compress: bool,
    ) -> None:
        """Finish one DCP folder once every worker is done: compress its rank files if asked, then write ``.metadata``.

        Rank 0's process only.

        Args:
            folder: the DCP folder (the output, or one of accelerate's folders in it).
            entries: every entry of the folder, in order.
            stored: every payload written to its rank files.
            version: DCP metadata version to record (the source's).
            compress: rewrite each payload as a zstd stream first (``writers.dcp.compress_data_files``,
                on every CPU core); compressed sizes are known only once compressed.

        Raises:
            FileExistsError: ``.metadata`` is already there.
            InvalidOptionError: ``compress`` without the ``zstandard`` package.
        """
        rows = list(stored)
        if compress:
            rows = compress_data_files(folder, rows, threads=len(os.sched_getaffinity(0)))
        write_metadata(folder, entries, rows, version)

    def finish_folder(self, output: Path, *, source: Path, beside: Sequence[str]) -> None:
        """Copy the producer's files beside the DCP data byte for byte (never loaded) into the output, fsynced.

        Rank 0's process only, after ``finish_metadata``.

        Args:
            output: the output folder (its temporary).
            source: the source checkpoint's folder.
            beside: names of the files in ``source`` to copy (``producers.Producer.side_files``).

        Raises:
            UnsafeContentError: a file is a symbolic link out of ``source`` (``location.open_inside``).
            FileExistsError: the output already holds one of them.
        """
        for name in beside:
            fd = open_inside(source, source / name)  # no file followed out of the checkpoint
            try:
                with open(fd, "rb", closefd=False) as src, open(output / name, "xb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())
            finally:
                os.close(fd)
