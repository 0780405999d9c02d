"""``writers.transaction.find_temporary``: which interrupted run's temporary ``--resume`` continues, read only."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fsdp_convert.errors import OutputWriteError
from fsdp_convert.writers.transaction import (
    Fingerprint,
    Record,
    RecordMap,
    find_temporary,
    start_manifest,
    temporary_output,
    temporary_path,
)

RECORDS = [(0, Record("", 0, 64)), (0, Record("", 64, 32))]
FINGERPRINT = Fingerprint(record_map=RecordMap({0: ""}, {"": 96}, RECORDS), source="checkpoint", options="options")


def _left(output: Path, tag: str | None, fingerprint: Fingerprint = FINGERPRINT) -> Path:
    """A temporary of ``output`` as a killed run of job ``tag`` leaves it: data and a manifest."""
    tmp = temporary_path(output, tag, directory=False)
    tmp.write_bytes(bytes(96))
    record_map = fingerprint.record_map
    records = [r for _, r in record_map.records]
    start_manifest(tmp, source=fingerprint.source, options=fingerprint.options, files=record_map.sizes, records=records)
    return tmp


def _find(output: Path, tag: str | None) -> Path | None:
    return find_temporary(output, tag, directory=False, fingerprint=FINGERPRINT)


def test_nothing_left_starts_afresh(tmp_path: Path) -> None:
    assert _find(tmp_path / "full.pt", "rdzv-b") is None


def test_the_jobs_own_temporary_comes_first(tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    own, _ = _left(out, "rdzv-b"), _left(out, "rdzv-a")
    assert _find(out, "rdzv-b") == own


@pytest.mark.parametrize(("killed", "now"), [("rdzv-a", "rdzv-b"), (None, "torchrun-1234"), ("torchrun-1234", None)])
def test_another_jobs_temporary_is_adopted(tmp_path: Path, killed: str | None, now: str | None) -> None:
    """A requeued job with a new id, a single-node run after a multi-node one, and the other way round."""
    out = tmp_path / "full.pt"
    left = _left(out, killed)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert _find(out, now) == left
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before  # read only


def test_several_left_are_refused_naming_them(tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    a, b = _left(out, "rdzv-a"), _left(out, "rdzv-b")
    with pytest.raises(OutputWriteError, match="2 interrupted runs left a temporary") as e:
        _find(out, "rdzv-c")
    assert str(a) in str(e.value) and str(b) in str(e.value)


def test_another_plans_temporary_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    other = Fingerprint(record_map=FINGERPRINT.record_map, source="checkpoint", options="--dtype bf16")
    left = _left(out, "rdzv-a", other)
    with pytest.raises(OutputWriteError, match="options that change the output differ") as e:
        _find(out, "rdzv-b")
    assert str(left) in str(e.value)


def test_a_temporary_without_manifest_is_not_adopted(tmp_path: Path) -> None:
    """Another job's temporary with no manifest (killed before rank 0 wrote it) is not resumed; the lock holder refuses
    it as a left temporary (``writers._atomic.check_no_temporary``)."""
    out = tmp_path / "full.pt"
    temporary_path(out, "rdzv-a", directory=False).write_bytes(bytes(10))
    assert _find(out, "rdzv-b") is None


def test_resume_without_a_manifest_says_it_starts_afresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An output to object storage (no fingerprint: its staging folder is private) cannot be resumed; a warning says so."""
    with (
        caplog.at_level(logging.WARNING),
        temporary_output(tmp_path / "full.pt", overwrite=False, directory=False, tag=None, fingerprint=None, resume=True) as (
            tmp,
            state,
        ),
    ):
        tmp.write_bytes(b"x")
    assert state is None and (tmp_path / "full.pt").read_bytes() == b"x"
    assert "keeps no manifest" in caplog.text and "writing it afresh" in caplog.text
