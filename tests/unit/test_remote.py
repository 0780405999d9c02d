"""remote.py and writers._staging.local_output: URLs join like paths; fsspec URL outputs are written locally, then uploaded.

fsspec's in-process ``memory://`` filesystem stands in for object storage; ``file://`` is a local path.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from fsdp_convert import remote
from fsdp_convert.errors import (
    CheckpointNotFoundError,
    InvalidOptionError,
    MissingDataFileError,
    OutputExistsError,
    OutputWriteError,
)
from fsdp_convert.remote import Url, as_location, is_url
from fsdp_convert.writers.transaction import local_output

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def bucket() -> Iterator[Url]:
    """A fresh folder on fsspec's memory filesystem, removed afterwards."""
    url = Url(f"memory://unit-{uuid.uuid4().hex}")
    fs = fsspec.filesystem("memory")
    fs.mkdir(url)
    yield url
    fs.rm(url, recursive=True)


def test_url_joins_and_names_like_a_path() -> None:
    url = Url("s3://bucket/ckpt/")
    assert url / "__0_0.distcp" == "s3://bucket/ckpt/__0_0.distcp"
    assert isinstance(url / "a", Url) and (url / "a" / "b").name == "b"
    assert url.name == "ckpt" and Url("s3://bucket").name == "bucket"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("s3://bucket/ckpt/", Url("s3://bucket/ckpt")),
        ("gs://b/x.pt", Url("gs://b/x.pt")),
        ("file:///tmp/ckpt", Path("/tmp/ckpt")),
        ("relative/ckpt", Path("relative/ckpt")),
        (Path("/abs/ckpt"), Path("/abs/ckpt")),
    ],
)
def test_as_location(text: Any, want: Path | Url) -> None:
    got = as_location(text)
    assert got == want and type(got) is type(want)
    assert is_url(text) == isinstance(want, Url)


def test_local_output_in_place_for_a_local_path(tmp_path: Path) -> None:
    with local_output(f"file://{tmp_path}/out.pt", overwrite=False, shared=False, last=()) as (local, reported):
        assert local == reported == tmp_path / "out.pt"


def test_local_output_uploads_when_the_block_completes(bucket: Url) -> None:
    fs = fsspec.filesystem("memory")
    with local_output(bucket / "out.pt", overwrite=False, shared=False, last=()) as (local, reported):
        assert reported == bucket / "out.pt" and local.name == "out.pt"
        local.write_bytes(b"whole file")
        assert not fs.exists(bucket / "out.pt")  # nothing appears before it is whole
    assert fs.cat_file(bucket / "out.pt") == b"whole file"
    assert not local.parent.exists()  # the staging folder is gone
    assert remote.read_range(bucket / "out.pt", 6, 4) == b"file" and remote.size_of(bucket / "out.pt") == 10


def test_local_output_uploads_the_named_files_last(bucket: Url, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = remote.filesystem("memory")
    order: list[str] = []
    put_file = fs.put_file
    monkeypatch.setattr(fs, "put_file", lambda lpath, rpath, **kw: (order.append(Url(rpath).name), put_file(lpath, rpath, **kw)))
    with local_output(bucket / "ckpt", overwrite=False, shared=False, last=(".metadata",)) as (local, _):
        local.mkdir()
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (local / name).write_bytes(name.encode())
    assert order == ["__0_0.distcp", "__1_0.distcp", ".metadata"]
    assert fs.cat_file(bucket / "ckpt" / ".metadata") == b".metadata"


def test_local_output_uploads_nothing_on_error(bucket: Url) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        local_output(bucket / "out.pt", overwrite=False, shared=False, last=()) as (local, _),
    ):
        local.write_bytes(b"partial")
        raise RuntimeError("boom")
    assert not fsspec.filesystem("memory").exists(bucket / "out.pt")
    assert not local.parent.exists()


def test_local_output_refuses_an_existing_url_unless_overwrite(bucket: Url) -> None:
    fsspec.filesystem("memory").pipe_file(bucket / "out.pt", b"old")
    with (
        pytest.raises(OutputExistsError, match="overwrite=True"),
        local_output(bucket / "out.pt", overwrite=False, shared=False, last=()),
    ):
        pass
    with local_output(bucket / "out.pt", overwrite=True, shared=False, last=()) as (local, _):
        local.write_bytes(b"new")
    assert fsspec.filesystem("memory").cat_file(bucket / "out.pt") == b"new"


def test_local_output_refuses_a_url_for_a_multi_node_run(bucket: Url) -> None:
    with (
        pytest.raises(InvalidOptionError, match="every node shares"),
        local_output(bucket / "o.pt", overwrite=False, shared=True, last=()),
    ):
        pass


def test_missing_objects_are_named(bucket: Url) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        remote.read_bytes(bucket / ".metadata")
    with pytest.raises(MissingDataFileError, match="is missing"):
        remote.read_range(bucket / "__0_0.distcp", 0, 4)
    assert remote.size_of(bucket / "nothing") is None and not remote.exists(bucket / "nothing")


def test_unknown_protocol_is_an_option_error() -> None:
    with pytest.raises(InvalidOptionError, match="not a known fsspec protocol"):
        remote.filesystem("nosuchproto")


def test_upload_in_waves_uploads_each_wave_while_the_next_is_written(bucket: Url, tmp_path: Path) -> None:
    """Each wave's files go up and are deleted locally; a wave is written while at most one earlier wave is still here."""
    fs = fsspec.filesystem("memory")
    seen: list[set[str]] = []

    def write(names: tuple[str, ...]) -> int:
        seen.append({p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()})
        for name in names:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(name.encode())
        return len(names)

    waves = [("a", "b"), ("c",), ("sub/d",), ("e",)]
    results, uploaded = remote.upload_in_waves(tmp_path, bucket, [(partial(write, w), w) for w in waves])
    assert results == [2, 1, 1, 1] and uploaded == sum(len(n) for w in waves for n in w)
    assert all(fs.cat_file(bucket / n) == n.encode() for w in waves for n in w)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    for k, here in enumerate(seen):  # wave k is written while wave k-1 may still be uploading, never an earlier one
        assert here <= set(waves[k - 1] if k else ())


def test_upload_in_waves_names_the_object_that_fails(bucket: Url, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = remote.filesystem("memory")

    def refuse(lpath: str, rpath: str, **kw: Any) -> None:
        raise PermissionError("access denied")

    monkeypatch.setattr(fs, "put_file", refuse)
    (tmp_path / "a").write_bytes(b"a")
    with pytest.raises(OutputWriteError, match=rf"^cannot write {bucket}/a: access denied$"):
        remote.upload_in_waves(tmp_path, bucket, [(lambda: None, ("a",))])


def test_a_failed_wave_removes_what_was_uploaded(bucket: Url, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")

    def write(names: tuple[str, ...]) -> None:
        for name in names:
            (tmp_path / name).write_bytes(name.encode())

    def fail() -> None:
        raise OSError("the worker died")

    with pytest.raises(OSError, match="the worker died"):
        remote.upload_in_waves(tmp_path, bucket, [(partial(write, ("a", "b")), ("a", "b")), (fail, ("c",))])
    assert not [n for n in ("a", "b", "c") if fs.exists(str(bucket / n))]
