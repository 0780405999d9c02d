"""Read stage, DCP payloads: a file object over one byte range of a data file that checks CRC-32s.

A DCP payload is a torch.save zip at ``[offset, offset + length)`` of a ``.distcp`` file
(``torch/distributed/checkpoint/filesystem.py`` ``_write_item``). ``torch.load`` reads it through
``ByteRangeFile``, which uses ``os.preadv`` into the buffers torch allocates (no intermediate
``bytes``, never outside the range) and hashes each zip record's data as it passes, so the CRC-32s
torch never checks cost no extra read. ``PayloadEdges`` is the other way in, without torch: a
payload's head (local headers, ``data.pkl``) and tail (last records, central directory) read
with one ``pread`` each, which is all ``DcpReader.locate`` needs to find the storage's bytes.
"""

from __future__ import annotations

import io
import os
from typing import Any

from fsdp_convert.formats.crc import crc32
from fsdp_convert.zip_records import ZipRecord

__all__ = ["ByteRangeFile", "RecordHash", "PayloadEdges", "EDGE_BYTES"]

EDGE_BYTES = 4096  # read at each end of a payload: its headers, pickle and directory (~1.5 KiB for one tensor)


class RecordHash:
    """Running CRC-32 of one zip record's data, fed by the reads torch.load makes anyway."""

    __slots__ = ("record", "crc", "done_to", "in_order")

    def __init__(self, record: ZipRecord) -> None:
        self.record = record
        self.crc = 0
        self.done_to = record.data_offset  # bytes hashed so far end here (offsets within the payload)
        self.in_order = True


class ByteRangeFile(io.RawIOBase):
    """A read-only, seekable file object over ``[offset, offset + length)`` of an open descriptor.

    Reads use ``os.preadv`` into the caller's buffer, so several readers can share one
    descriptor and nothing outside the range is ever read. Given the zip records of the payload,
    it also hashes each record's data as it passes (``formats.crc.crc32``, ISA-L's, 15 GB/s or more), so checking
    CRC-32s costs no extra read.

    Args:
        fd: an open descriptor of the data file.
        offset_bytes: start of the range in the file, in bytes.
        length_bytes: length of the range, in bytes.
        records: zip records to hash, with offsets relative to the range's start.
    """

    def __init__(self, fd: int, offset_bytes: int, length_bytes: int, records: list[ZipRecord] | None = None) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, offset_bytes, length_bytes, 0
        self.hashes = [RecordHash(r) for r in records or ()]
        self.error: BaseException | None = None

    def readable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Always true."""
        return True

    def tell(self) -> int:
        """Position within the range, in bytes."""
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move within the range (clamped at 0); return the new position in bytes."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def pread(self, length: int, offset: int) -> bytes:
        """Read up to ``length`` bytes at ``offset`` within the range (fewer at its end)."""
        length = max(0, min(length, self._length - offset))
        return os.pread(self._fd, length, self._start + offset)

    def readinto(self, buffer: Any) -> int:
        """Read up to ``len(buffer)`` bytes of the range into ``buffer``; 0 at the end.

        torch.load calls this from C++; an exception (a read error, or Ctrl-C landing here) must
        not cross that code, so it is kept in ``error``, the read reports the end of the range,
        and the caller re-raises it once torch.load returns.
        """
        if self.error is not None:
            return 0
        try:
            return self._readinto(buffer)
        except BaseException as e:
            self.error = e
            return 0

    def _readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._start + self._pos)
        begin, end = self._pos, self._pos + got
        for h in self.hashes:
            lo, hi = max(begin, h.record.data_offset), min(end, h.record.data_offset + h.record.size)
            if lo >= hi:
                continue
            if lo == h.done_to and h.in_order:
                h.crc = crc32(view[lo - begin : hi - begin], h.crc)
                h.done_to = hi
            elif hi > h.done_to:
                h.in_order = False  # re-read once at the end
        self._pos = end
        return got

    def finish_crcs(self) -> list[tuple[ZipRecord, int]]:
        """Complete every record's CRC-32 (reading what torch did not) and return the mismatches.

        Returns:
            ``(record, computed_crc)`` for each record whose data does not match its stored CRC.
        """
        bad = []
        for h in self.hashes:
            end = h.record.data_offset + h.record.size
            if not h.in_order:
                h.crc, h.done_to = 0, h.record.data_offset
            while h.done_to < end:
                data = self.pread(min(end - h.done_to, 16 << 20), h.done_to)
                if not data:
                    break
                h.crc = crc32(data, h.crc)
                h.done_to += len(data)
            if h.crc != h.record.crc32:
                bad.append((h.record, h.crc))
        return bad


class PayloadEdges:
    """The first and last ``EDGE_BYTES`` of a payload read once; other reads go to the file.

    A one-tensor torch.save zip keeps everything but the storage's data at its two ends, so
    parsing its zip records and pickle and checking their CRC-32s takes two ``pread`` calls
    instead of one per structure.

    Args:
        fd: an open descriptor of the data file.
        offset_bytes: start of the payload in the file, in bytes.
        length_bytes: length of the payload, in bytes.
    """

    __slots__ = ("_fd", "_start", "_length", "_head", "_tail", "_tail_at", "whole")

    def __init__(self, fd: int, offset_bytes: int, length_bytes: int) -> None:
        self._fd, self._start, self._length = fd, offset_bytes, length_bytes
        self.whole: bytes | None = None  # the payload, where it was read at once
        if length_bytes <= 2 * EDGE_BYTES:
            self._head = self._tail = self.whole = os.pread(fd, length_bytes, offset_bytes)
            self._tail_at = 0
        else:
            self._head = os.pread(fd, EDGE_BYTES, offset_bytes)
            self._tail_at = length_bytes - EDGE_BYTES
            self._tail = os.pread(fd, EDGE_BYTES, offset_bytes + self._tail_at)

    def pread(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` within the payload (fewer at its end)."""
        length = max(0, min(length, self._length - offset))
        if offset + length <= len(self._head):
            return self._head[offset : offset + length]
        if offset >= self._tail_at and offset + length <= self._tail_at + len(self._tail):
            return self._tail[offset - self._tail_at : offset - self._tail_at + length]
        return os.pread(self._fd, length, self._start + offset)

    def crc_mismatches(self, records: list[ZipRecord]) -> list[tuple[ZipRecord, int]]:
        """``(record, computed CRC-32)`` for each of ``records`` whose data does not match its stored CRC-32."""
        bad = []
        for record in records:
            crc, done, end = 0, record.data_offset, record.data_offset + record.size
            while done < end:
                data = self.pread(min(end - done, 16 << 20), done)
                if not data:
                    break
                crc, done = crc32(data, crc), done + len(data)
            if crc != record.crc32:
                bad.append((record, crc))
        return bad
