"""The resumable output's manifest (writers._manifest): fingerprint checks, record logs, CRC-checked rereads."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

from fsdp_convert.errors import OutputWriteError
from fsdp_convert.writers._manifest import (
    Record,
    RecordLog,
    check_manifest,
    digest,
    has_manifest,
    kept_records,
    manifest_dir,
    remove_manifest,
    start_manifest,
    written_bytes,
)

RECORDS = [Record("", 0, 8), Record("", 8, 8), Record("", 16, 4)]
FILES = {"": 20}


def _tmp(tmp_path: Path) -> Path:
    tmp = tmp_path / ".full.tmp-local.pt"
    tmp.write_bytes(bytes(range(20)))
    start_manifest(tmp, source="s", options="o", files=FILES, records=RECORDS)
    return tmp


def test_manifest_dir_is_not_a_temporary_name(tmp_path: Path) -> None:
    assert manifest_dir(tmp_path / ".full.tmp-local.pt").name == ".full.manifest-local.pt"
    assert manifest_dir(tmp_path / ".OUT.tmp-local").name == ".OUT.manifest-local"


def test_manifest_is_json_with_the_fingerprint(tmp_path: Path) -> None:
    tmp = _tmp(tmp_path)
    assert has_manifest(tmp)
    doc = json.loads((manifest_dir(tmp) / "manifest.json").read_text())
    assert doc["version"] == 1 and doc["files"] == FILES and doc["records"] == 3
    assert set(doc["fingerprint"]) == {"source", "options", "layout"}
    check_manifest(tmp, source="s", options="o", files=FILES, records=RECORDS)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"source": "x"}, "the checkpoint differs"),
        ({"options": "x"}, "the options"),
        ({"files": {"": 24}}, "(the output file): 20 bytes then, 24 now"),
        ({"records": [*RECORDS[:2], Record("", 16, 2)]}, "record offsets"),
    ],
)
def test_check_names_what_differs(tmp_path: Path, change: dict[str, object], named: str) -> None:
    tmp = _tmp(tmp_path)
    kwargs: dict[str, object] = {"source": "s", "options": "o", "files": FILES, "records": RECORDS, **change}
    with pytest.raises(OutputWriteError) as info:
        check_manifest(tmp, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert named in message and str(tmp) in message and "\n" not in message


def test_check_without_manifest_names_it(tmp_path: Path) -> None:
    with pytest.raises(OutputWriteError, match="no usable manifest"):
        check_manifest(tmp_path / ".x.tmp-local.pt", source="s", options="o", files=FILES, records=RECORDS)


def test_kept_records_reread_and_check_every_crc(tmp_path: Path) -> None:
    tmp = _tmp(tmp_path)
    log = RecordLog(tmp, "0")
    fd = os.open(tmp, os.O_RDWR)
    data = tmp.read_bytes()
    for r in RECORDS[:2]:
        log.append(r, zlib.crc32(data[r.offset : r.offset + r.nbytes]), fd, "fqn")
    log.append(Record("", 99, 4), 0, fd, "not in the plan")
    log.close()
    os.close(fd)
    with open(manifest_dir(tmp) / "records-0.jsonl", "a") as f:
        f.write('["", 16, 4, 12')  # a SIGKILL mid-append: a torn last line
    assert set(kept_records(tmp, RECORDS, lambda _: tmp)) == {RECORDS[0], RECORDS[1]}
    with open(tmp, "r+b") as f:  # a byte flipped in the second record
        f.seek(9)
        f.write(b"\xff")
    assert set(kept_records(tmp, RECORDS, lambda _: tmp)) == {RECORDS[0]}


def test_digest_ignores_object_addresses() -> None:
    class Thing:
        pass

    assert digest(Thing) == digest(Thing) and digest(Thing()) == digest(Thing())
    assert digest(1, "a") != digest("1", "a")


def test_remove_manifest(tmp_path: Path) -> None:
    tmp = _tmp(tmp_path)
    remove_manifest(tmp)
    assert not manifest_dir(tmp).exists() and tmp.exists()


def test_written_bytes_counts_each_logged_record_once(tmp_path: Path) -> None:
    """What the kept-temporary line says: the logged records' bytes (one logged twice counts once) of the planned size."""
    assert written_bytes(tmp_path / ".none.tmp-local.pt") == (0, 0)
    tmp = _tmp(tmp_path)
    assert written_bytes(tmp) == (0, 20)
    log = RecordLog(tmp, "0")
    fd = os.open(tmp, os.O_RDWR)
    for r in (RECORDS[0], RECORDS[2], RECORDS[0]):  # a resumed run logs a rewritten record again
        log.append(r, 0, fd, "fqn")
    log.close()
    os.close(fd)
    assert written_bytes(tmp) == (12, 20)


def test_records_are_logged_in_batches_after_their_data_is_fdatasynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line is appended only once its batch (``LOG_BATCH_BYTES`` of data) is full, after every data file of the batch is
    fdatasync'ed; ``flush`` and ``close`` log what is pending."""
    import fsdp_convert.writers._manifest as manifest

    monkeypatch.setattr(manifest, "LOG_BATCH_BYTES", 16)
    synced: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(manifest.os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd))[1])
    tmp = _tmp(tmp_path)
    lines = manifest_dir(tmp) / "records-0.jsonl"
    log = RecordLog(tmp, "0")
    fd = os.open(tmp, os.O_RDWR)
    log.append(RECORDS[0], 1, fd, "a")  # 8 bytes: below the batch
    assert lines.read_text() == "" and synced == []
    log.append(RECORDS[1], 2, fd, "b")  # 16 bytes: the batch is full
    assert [json.loads(line)[3] for line in lines.read_text().splitlines()] == [1, 2]
    assert synced[0] == fd and len(synced) == 2  # the data file first, then the log
    log.append(RECORDS[2], 3, fd, "c")
    log.flush()
    assert [json.loads(line)[3] for line in lines.read_text().splitlines()] == [1, 2, 3]
    log.append(Record("", 0, 8), 4, fd, "a again")
    log.close()  # a stop closes the log: what is pending is logged
    os.close(fd)
    assert [json.loads(line)[3] for line in lines.read_text().splitlines()] == [1, 2, 3, 4]
