"""writers/transaction.py: OutputTransaction, the one context an operation writes its output in (real files in tmp_path)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_convert.errors import InvalidOptionError, OutputExistsError, OutputWriteError, TemporaryExistsError
from fsdp_convert.remote import Url
from fsdp_convert.writers.transaction import (
    Fingerprint,
    LeaveToOwner,
    OutputTransaction,
    Record,
    RecordMap,
    kept_note,
    start_manifest,
    temporary_path,
)

RECORDS = [(0, Record("", 0, 64)), (0, Record("", 64, 32))]
FINGERPRINT = Fingerprint(record_map=RecordMap({0: ""}, {"": 96}, RECORDS), source="checkpoint", options="options")


def _checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"m")
    return ckpt


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _start_manifest(tmp: Path) -> None:
    """What rank 0's worker does first on a resumable output (``resume.begin_share``)."""
    records = [r for _, r in FINGERPRINT.record_map.records]
    start_manifest(tmp, source="checkpoint", options="options", files=FINGERPRINT.record_map.sizes, records=records)


def test_a_completed_block_renames_the_temporary_into_place(tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "full.pt"
    with OutputTransaction(out, inputs=(ckpt, None)) as tx:
        assert tx.output == out and tx.shown == out and tx.url is None and tx.tag is None
        tmp, resumable = tx.begin(directory=False, needed_bytes=3, fingerprint=None, resume=False)
        assert tmp == temporary_path(out, None, directory=False) and resumable is None
        assert (tmp_path / ".full.pt.lock").exists()  # held until the rename
        tmp.write_bytes(b"new")
        assert not out.exists()
    assert out.read_bytes() == b"new"
    assert _names(tmp_path) == ["ckpt", "full.pt"]  # no temporary, no lock


def test_an_error_leaves_nothing(tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "hf"
    with pytest.raises(RuntimeError, match="boom"), OutputTransaction(out, inputs=(ckpt,)) as tx:
        tmp, _ = tx.begin(directory=True, needed_bytes=None, fingerprint=FINGERPRINT, resume=False)
        (tmp / "model.safetensors").write_bytes(b"partial")
        _start_manifest(tmp)
        raise RuntimeError("boom")
    assert _names(tmp_path) == ["ckpt"]  # temporary, its manifest and the lock removed


def test_an_existing_output_is_replaced_only_at_the_end(tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "full.pt"
    out.write_bytes(b"old")
    with pytest.raises(OutputExistsError):
        OutputTransaction(out, inputs=(ckpt,))  # checked at once, before anything is read
    with OutputTransaction(out, inputs=(ckpt,), overwrite=True) as tx:
        tmp, _ = tx.begin(directory=False, needed_bytes=None, fingerprint=None, resume=False)
        tmp.write_bytes(b"new")
        assert out.read_bytes() == b"old"
    assert out.read_bytes() == b"new"


def test_an_output_taken_after_the_check_is_refused_by_check_free_and_begin(tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "full.pt"
    with OutputTransaction(out, inputs=(ckpt,)) as tx:
        out.write_bytes(b"another run's")
        with pytest.raises(OutputExistsError):
            tx.check_free(directory=False)
        with pytest.raises(OutputExistsError):
            tx.begin(directory=False, needed_bytes=None, fingerprint=None, resume=False)
    assert _names(tmp_path) == ["ckpt", "full.pt"] and out.read_bytes() == b"another run's"


def test_an_interrupted_resumable_run_keeps_its_temporary_and_resume_finishes_it(tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "full.pt"
    with pytest.raises(KeyboardInterrupt) as stopped, OutputTransaction(out, inputs=(ckpt,)) as tx:
        tmp, state = tx.begin(directory=False, needed_bytes=96, fingerprint=FINGERPRINT, resume=False)
        assert state is not None and state.fingerprint is FINGERPRINT and not state.resume
        _start_manifest(tmp)
        tmp.write_bytes(bytes(64))
        raise KeyboardInterrupt
    note = kept_note(stopped.value)
    assert note is not None and str(tmp) in note and "--resume" in note
    assert tmp.exists() and not out.exists() and not (tmp_path / ".full.pt.lock").exists()
    with pytest.raises(TemporaryExistsError, match="is left from an earlier run"), OutputTransaction(out, inputs=(ckpt,)) as tx:
        tx.begin(directory=False, needed_bytes=96, fingerprint=FINGERPRINT, resume=False)
    with OutputTransaction(out, inputs=(ckpt,)) as tx:
        again, state = tx.begin(directory=False, needed_bytes=96, fingerprint=FINGERPRINT, resume=True)
        assert again == tmp and state is not None and state.resume
        assert again.read_bytes() == bytes(64)  # kept as it was
        again.write_bytes(bytes(96))
    assert out.read_bytes() == bytes(96)
    assert _names(tmp_path) == ["ckpt", "full.pt"]  # manifest removed with the temporary


def test_an_error_that_is_not_an_interruption_removes_a_resumable_temporary(tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "full.pt"
    with pytest.raises(OutputWriteError), OutputTransaction(out, inputs=(ckpt,)) as tx:
        tmp, _ = tx.begin(directory=False, needed_bytes=None, fingerprint=FINGERPRINT, resume=False)
        _start_manifest(tmp)
        raise OutputWriteError("no space")
    assert _names(tmp_path) == ["ckpt"]


def test_leave_to_owner_leaves_no_output_and_the_shared_temporary_to_rank_0(tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "hf"
    after = False
    with OutputTransaction(out, inputs=(ckpt,), tag="rdzv-job1") as tx:
        tmp, _ = tx.begin(directory=True, needed_bytes=None, fingerprint=None, resume=False)
        (tmp / "model-00001-of-00002.safetensors").write_bytes(b"my share")
        raise LeaveToOwner
    after = True  # not an error: the block is left quietly
    assert after and not out.exists()
    assert tmp == tmp_path / ".hf.tmp-rdzv-job1" and _names(tmp) == ["model-00001-of-00002.safetensors"]
    assert (tmp_path / ".hf.lock").exists()  # rank 0's process removes it once the output is in place


def test_out_onto_the_input_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    for out in (ckpt, ckpt / "full.pt", tmp_path):
        with pytest.raises(InvalidOptionError):
            OutputTransaction(out, inputs=(ckpt,), overwrite=True)
    hf_assets = tmp_path / "assets"
    hf_assets.mkdir()
    with pytest.raises(InvalidOptionError):
        OutputTransaction(hf_assets / "hf", inputs=(ckpt, hf_assets))
    assert _names(tmp_path) == ["assets", "ckpt"] and _names(ckpt) == [".metadata"] and _names(hf_assets) == []


def test_a_space_check_refusal_creates_nothing(tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "full.pt"
    with (
        pytest.raises(OutputWriteError, match="No space left on device: it needs"),
        OutputTransaction(out, inputs=(ckpt,)) as tx,
    ):
        tx.begin(directory=False, needed_bytes=1 << 62, fingerprint=FINGERPRINT, resume=False)
    assert _names(tmp_path) == ["ckpt"]  # no temporary, no lock


def test_begin_is_called_once_inside_the_block(tmp_path: Path) -> None:
    tx = OutputTransaction(tmp_path / "full.pt", inputs=())
    with pytest.raises(RuntimeError):
        tx.begin(directory=False, needed_bytes=None, fingerprint=None, resume=False)
    with tx, pytest.raises(RuntimeError):
        tmp, _ = tx.begin(directory=False, needed_bytes=None, fingerprint=None, resume=False)
        tmp.write_bytes(b"x")
        tx.begin(directory=False, needed_bytes=None, fingerprint=None, resume=False)
    assert (tmp_path / "full.pt").read_bytes() == b"x"


@pytest.fixture
def bucket() -> Iterator[Url]:
    """A fresh folder on fsspec's memory filesystem, removed afterwards."""
    fsspec = pytest.importorskip("fsspec")
    url = Url(f"memory://unit-{uuid.uuid4().hex}")
    fs = fsspec.filesystem("memory")
    fs.mkdir(url)
    yield url
    fs.rm(url, recursive=True)


def test_a_url_output_is_staged_then_uploaded_and_keeps_no_manifest(bucket: Url, tmp_path: Path) -> None:
    import fsspec  # type: ignore[import-untyped]

    ckpt, out = _checkpoint(tmp_path), bucket / "hf"
    with OutputTransaction(str(out), inputs=(ckpt,), last=("model.safetensors.index.json",)) as tx:
        assert tx.url == out and tx.shown == out and tx.output.name == "hf" and tx.output.parent != tmp_path
        tmp, resumable = tx.begin(directory=True, needed_bytes=2, fingerprint=FINGERPRINT, resume=False)
        assert resumable is None  # a private staging folder: nothing to resume
        (tmp / "a.safetensors").write_bytes(b"a")
        (tmp / "model.safetensors.index.json").write_bytes(b"{}")
        assert not fsspec.filesystem("memory").exists(out / "a.safetensors")
    fs = fsspec.filesystem("memory")
    assert fs.cat_file(out / "a.safetensors") == b"a" and fs.cat_file(out / "model.safetensors.index.json") == b"{}"
    assert not tx.output.parent.exists()  # the staging folder is gone


def test_a_url_output_uploads_nothing_on_error(bucket: Url, tmp_path: Path) -> None:
    import fsspec

    out = bucket / "full.pt"
    with pytest.raises(RuntimeError), OutputTransaction(str(out), inputs=()) as tx:
        tmp, _ = tx.begin(directory=False, needed_bytes=None, fingerprint=None, resume=False)
        tmp.write_bytes(b"partial")
        raise RuntimeError("boom")
    assert fsspec.filesystem("memory").ls(bucket) == []  # no object, no lock object


def test_a_url_output_is_refused_for_a_multi_node_run(bucket: Url) -> None:
    tx = OutputTransaction(str(bucket / "full.pt"), inputs=(), tag="rdzv-job1")
    with pytest.raises(InvalidOptionError, match="multi-node"), tx:
        pass
