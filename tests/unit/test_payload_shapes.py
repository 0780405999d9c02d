"""formats/_payload_shapes.py: a payload matched against one parsed before gets the answer a full parse gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_convert.formats import dcp as dcp_format
from fsdp_convert.formats import read_index
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.formats.index import ChunkEntry, TensorEntry

SHAPE = (2, 3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[TensorEntry]]:
    """A DCP folder of four tensors of one shape and dtype (one payload each, distinct values), and one of another."""
    folder = tmp_path_factory.mktemp("shapes")
    state = {f"w{i}": torch.arange(6, dtype=torch.float32).reshape(SHAPE) * (i + 1) for i in range(4)}
    state["other"] = torch.ones(3, 2, dtype=torch.float32)
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder, list(read_index(folder).tensors())


def _answer(reader: DcpReader, entry: TensorEntry, chunk: ChunkEntry) -> object:
    """What ``locate`` says of a chunk: its stored bytes, or the error it raises."""
    try:
        stored = reader.locate(entry, chunk)
    except Exception as e:  # noqa: BLE001  (the answer compared)
        return (type(e).__name__, str(e))
    return None if stored is None else (stored.offset, stored.nbytes, stored.crc32)


def test_payloads_of_one_shape_are_parsed_once(saved: tuple[Path, list[TensorEntry]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shape's first payload is parsed; the others of that shape are matched, with the same answers."""
    folder, entries = saved
    fresh = {}
    for entry in entries:
        with DcpReader(folder) as reader:
            fresh[entry.fqn] = _answer(reader, entry, entry.chunks[0])
    parsed = []
    real = dcp_format.read_records
    monkeypatch.setattr(dcp_format, "read_records", lambda pread, size: parsed.append(size) or real(pread, size))
    with DcpReader(folder) as reader:
        learned = {entry.fqn: _answer(reader, entry, entry.chunks[0]) for entry in entries}
    assert learned == fresh and all(isinstance(a, tuple) and len(a) == 3 for a in fresh.values())
    assert len(parsed) == 2  # w0 and other; w1..w3 matched against w0's


@pytest.mark.parametrize("check_crc", [True, False])
def test_any_byte_changed_gives_the_full_parses_answer(
    saved: tuple[Path, list[TensorEntry]], tmp_path: Path, check_crc: bool
) -> None:
    """Every byte of a payload of a learned shape flipped in turn: the matching reader answers as a fresh reader does.

    A changed storage byte or storage CRC-32 is the mover's to find (the CRC-32 it returns is the
    file's); a changed serialization id, pickle, header or directory byte is refused or parsed
    whole, never taken as the learned shape.
    """
    folder, entries = saved
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    by_name = {e.fqn: e for e in entries}
    first, second = by_name["w0"], by_name["w1"]
    chunk = second.chunks[0]
    assert chunk.relative_path is not None
    data_file = copy / chunk.relative_path
    original = data_file.read_bytes()
    answers = set()
    for at in range(chunk.offset_bytes, chunk.offset_bytes + chunk.length_bytes):
        raw = bytearray(original)
        raw[at] ^= 0x10
        data_file.write_bytes(raw)
        with DcpReader(copy, check_crc=check_crc) as fresh_reader:
            fresh = _answer(fresh_reader, second, chunk)
        with DcpReader(copy, check_crc=check_crc) as reader:
            assert isinstance(_answer(reader, first, first.chunks[0]), tuple)  # w0's shape learned
            assert _answer(reader, second, chunk) == fresh, f"byte {at - chunk.offset_bytes} of the payload"
        answers.add("located" if isinstance(fresh, tuple) and len(fresh) == 3 else str(fresh)[:40])
    data_file.write_bytes(original)
    assert "located" in answers and len(answers) >= 3  # storage bytes located; refusals and parse errors met too
