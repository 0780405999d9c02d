"""Move stage, its record: the pieces a worker wrote (output offset, length, CRC-32), and an output range's CRC-32 from them.

Every write of a mover is one ``Piece``. Rank 0 gathers every worker's pieces and fills in the
output's CRC-32 fields (zip headers, a resumable output's records) by combining theirs
(``formats.crc.combine``), without reading the data back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_convert.formats.crc import combine, crc32

__all__ = ["Piece", "pieces_crc", "range_crc"]


@dataclass(frozen=True, slots=True)
class Piece:
    """One contiguous run written to an output file.

    Attributes:
        file: index of the output file (``WorkPlan.files``).
        offset: start in the file, in bytes.
        nbytes: length, in bytes.
        crc32: CRC-32 of the bytes written.
    """

    file: int
    offset: int
    nbytes: int
    crc32: int


def pieces_crc(pieces: Sequence[Piece]) -> int | None:
    """CRC-32 of pieces written back to back (in order), without reading them; None without any ``crc32_combine``."""
    return combine((p.crc32, p.nbytes) for p in pieces)


def range_crc(fd: int, by_offset: dict[int, Piece], offset: int, nbytes: int) -> int:
    """CRC-32 of bytes ``[offset, offset + nbytes)`` of an output file, from the pieces written there.

    Args:
        fd: the output file, open for reading (read back only without any ``crc32_combine``).
        by_offset: the pieces written to that file, by their offset in bytes.
        offset: start of the range, in bytes.
        nbytes: its length, in bytes.

    Raises:
        RuntimeError: the pieces do not tile the range (a planning bug).
    """
    parts, at = [], offset
    while at < offset + nbytes:
        piece = by_offset.get(at)
        if piece is None:
            raise RuntimeError(f"no worker wrote byte {at} of a tensor at [{offset}, {offset + nbytes})")
        parts.append(piece)
        at += piece.nbytes
    crc = pieces_crc(parts)
    if crc is None:  # no crc32_combine at all: hash the bytes back
        crc = 0
        for at in range(offset, offset + nbytes, 16 << 20):
            crc = crc32(os.pread(fd, min(16 << 20, offset + nbytes - at), at), crc)
    return crc
