"""zip_records.py: read_records finds every record of a torch.save zip where zipfile does, and refuses what is not one."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from fsdp_convert.zip_records import ZipFormatError, ZipRecord, read_records


def _torch_save_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(300, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int16), "n": 3}, buf)
    return buf.getvalue()


def _records(data: bytes) -> list[ZipRecord]:
    return read_records(lambda length, offset: data[offset : offset + length], len(data))


def test_records_match_zipfile() -> None:
    data = _torch_save_bytes()
    records = _records(data)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = zf.infolist()
        assert [r.name for r in records] == [i.filename for i in infos]
        for r, info in zip(records, infos, strict=True):
            assert (r.local_offset, r.size, r.crc32, r.compression) == (info.header_offset, info.file_size, info.CRC, 0)
            assert data[r.data_offset : r.data_offset + r.size] == zf.read(info)
    names = {r.short_name for r in records}
    assert {"data.pkl", "data/0", "data/1", "version"} <= names
    assert all(r.has_descriptor for r in records if r.short_name.startswith("data/"))  # torch's writer sets bit 3


def test_records_are_found_inside_a_larger_file_through_pread_offsets() -> None:
    data = _torch_save_bytes()
    blob = b"x" * 100 + data + b"y" * 50
    records = read_records(lambda length, offset: blob[100 + offset : 100 + min(offset + length, len(data))], len(data))
    assert records == _records(data)


@pytest.mark.parametrize(
    "cut",
    [
        lambda d: d[:-1],  # range too short: the end record is cut
        lambda d: d + b"\0" * 9,  # range too long: takes in the next payload's bytes
        lambda d: d[:10],
        lambda d: b"not a zip at all, just some bytes that are long enough",
    ],
)
def test_a_range_that_is_not_exactly_one_zip_is_refused(cut: object) -> None:
    data = cut(_torch_save_bytes())  # type: ignore[operator]
    with pytest.raises(ZipFormatError):
        _records(data)
