"""formats/_range.py: ByteRangeFile reads one byte range of a file, never outside it, and checks its zip records' CRC-32s."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fsdp_convert.formats._range import ByteRangeFile
from fsdp_convert.zip_records import ZipRecord, read_records

BEFORE, AFTER = b"<" * 37, b">" * 41  # bytes around the range that must never be read


def _payload() -> bytes:
    """A torch.save zip, like one DCP payload."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(300, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int16)}, buf)
    return buf.getvalue()


def _records(payload: bytes) -> list[ZipRecord]:
    return read_records(lambda length, offset: payload[offset : offset + length], len(payload))


@pytest.fixture
def data_file(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    """An open descriptor of a file holding a payload between other bytes, and the payload."""
    payload = _payload()
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(BEFORE + payload + AFTER)
    fd = os.open(path, os.O_RDONLY)
    yield fd, payload
    os.close(fd)


def test_reads_stay_inside_the_range(data_file: tuple[int, bytes]) -> None:
    fd, payload = data_file
    f = ByteRangeFile(fd, len(BEFORE), len(payload))
    assert f.read() == payload
    assert f.read() == b""  # at the end: nothing of AFTER
    f.seek(-5, io.SEEK_END)
    assert f.read(100) == payload[-5:]
    f.seek(-10, io.SEEK_SET)  # clamped at the start, never into BEFORE
    assert f.tell() == 0 and f.read(3) == payload[:3]
    buffer = bytearray(len(payload) + 50)
    f.seek(0)
    assert f.readinto(buffer) == len(payload) and buffer[len(payload) :] == bytes(50)
    assert f.pread(1000, len(payload) - 4) == payload[-4:]


def test_torch_load_through_the_range_gives_the_payload(data_file: tuple[int, bytes]) -> None:
    fd, payload = data_file
    f = ByteRangeFile(fd, len(BEFORE), len(payload), _records(payload))
    state = torch.load(f, map_location="cpu", weights_only=True)
    assert torch.equal(state["w"], torch.arange(300, dtype=torch.float32))
    assert f.error is None and f.finish_crcs() == []


@pytest.mark.parametrize("read", ["in order", "out of order", "not at all"])
def test_a_corrupted_record_is_detected(tmp_path: Path, read: str) -> None:
    """One byte of a tensor's data changed: finish_crcs names that record (and only it), however it was read."""
    payload = _payload()
    records = _records(payload)
    target = max(records, key=lambda r: r.size)  # the 300 floats
    corrupt = bytearray(payload)
    corrupt[target.data_offset + target.size // 2] ^= 0xFF
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(BEFORE + bytes(corrupt) + AFTER)
    fd = os.open(path, os.O_RDONLY)
    try:
        f = ByteRangeFile(fd, len(BEFORE), len(payload), records)
        if read == "in order":
            f.read()
        elif read == "out of order":
            f.seek(target.data_offset + 16)
            f.read(64)
            f.seek(0)
            f.read()
        bad = f.finish_crcs()
    finally:
        os.close(fd)
    assert [record.name for record, _ in bad] == [target.name]
    assert bad[0][1] != target.crc32


def test_a_read_error_is_kept_for_the_caller() -> None:
    """An exception inside readinto (called from torch's C++) is kept in ``error``; the read reports the end."""
    bad = ByteRangeFile(-1, 0, 10)  # not a descriptor
    assert bad.readinto(bytearray(4)) == 0 and isinstance(bad.error, OSError)
    assert bad.readinto(bytearray(4)) == 0  # stays at the end
