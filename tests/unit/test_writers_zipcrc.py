"""writers/_zipcrc.py: patch_crcs writes the CRC-32s torch's writer left 0, so zipfile and torch.load check them."""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

import torch

from fsdp_convert.torch_compat import open_torch_save_writer
from fsdp_convert.writers._zipcrc import FileImage, patch_crcs
from fsdp_convert.zip_records import read_records

PAYLOADS = {"data/0": bytes(range(256)) * 3, "data/1": b"\x07" * 100, "extra": b"small record"}


def _zip_without_crcs(path: Path) -> None:
    with open(path, "wb") as f:
        writer = open_torch_save_writer(f, compute_crc32=False)
        for name, raw in PAYLOADS.items():
            writer.write_record(name, raw, len(raw))
        writer.write_end_of_file()
        del writer


def _crcs(path: Path) -> dict[str, int]:
    data = path.read_bytes()
    return {r.short_name: r.crc32 for r in read_records(lambda n, o: data[o : o + n], len(data))}


def test_patch_fills_every_crc_given_or_not(tmp_path: Path) -> None:
    path = tmp_path / "z.pt"
    _zip_without_crcs(path)
    assert {_crcs(path)[name] for name in PAYLOADS} == {0}  # what the fix-up starts from
    with open(path, "r+b") as f:
        patch_crcs(FileImage(f.fileno()), {"data/0": zlib.crc32(PAYLOADS["data/0"])})  # the others are hashed by patch_crcs
    crcs = _crcs(path)
    assert all(crcs[name] == zlib.crc32(raw) for name, raw in PAYLOADS.items())
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # checks each record's data against its CRC
        descriptor_crcs = {i.filename.split("/", 1)[1]: i.CRC for i in zf.infolist()}
    assert all(descriptor_crcs[name] == zlib.crc32(raw) for name, raw in PAYLOADS.items())


def test_a_wrong_given_crc_is_written_as_given(tmp_path: Path) -> None:
    path = tmp_path / "z.pt"
    _zip_without_crcs(path)
    with open(path, "r+b") as f:
        patch_crcs(FileImage(f.fileno()), {"data/1": 12345})
    assert _crcs(path)["data/1"] == 12345
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is not None  # so a caller's wrong hash would show


def test_torch_save_output_still_loads_after_patching(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    buf = io.BytesIO()
    torch.save({"w": torch.arange(10.0)}, buf)
    path.write_bytes(buf.getvalue())
    before = path.read_bytes()
    with open(path, "r+b") as f:
        patch_crcs(FileImage(f.fileno()), {})
    assert path.read_bytes() == before  # right CRCs are rewritten unchanged
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(10.0))
