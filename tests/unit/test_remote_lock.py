"""writers/_object_lock.py: one writer per object-storage output, a lock object ``.<name>.lock`` beside it, on ``memory://``."""

from __future__ import annotations

import errno
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fsdp_convert import remote
from fsdp_convert.errors import InvalidOptionError, OutputLockedError, OutputWriteError
from fsdp_convert.lock_record import LockRecord
from fsdp_convert.remote import Url
from fsdp_convert.writers import _object_lock
from fsdp_convert.writers._object_lock import lock_url, object_lock
from fsdp_convert.writers.transaction import local_output
from tests.unit.test_writers_lock import _dead_pid

fsspec = pytest.importorskip("fsspec")
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

HOST = socket.gethostname()


@pytest.fixture
def out() -> Iterator[Url]:
    """An output URL in a fresh folder of fsspec's memory filesystem, removed afterwards."""
    folder = Url(f"memory://unit-lock-{uuid.uuid4().hex}")
    fs = fsspec.filesystem("memory")
    fs.mkdir(folder)
    yield folder / "full.pt"
    fs.rm(folder, recursive=True)


def _fs() -> Any:
    return remote.filesystem("memory")


def _record(lock: Url) -> LockRecord | None:
    return LockRecord.parse(_fs().cat_file(lock).decode())


def _refusal(url: Url, who: str) -> str:
    lock = lock_url(url)
    return f"{url} is being written by {who} (lock {lock}); wait for it, or remove the lock if that process is gone"


def test_the_lock_is_a_sibling_named_like_the_local_lock_file() -> None:
    assert lock_url(Url("s3://bucket/out/full.pt")) == "s3://bucket/out/.full.pt.lock"
    assert lock_url(Url("s3://bucket/hf/")) == "s3://bucket/.hf.lock"
    with pytest.raises(InvalidOptionError, match=r"name a path inside the bucket; the output's lock \.bucket\.lock"):
        lock_url(Url("s3://bucket"))


def test_the_lock_is_created_exclusively_and_names_its_holder(out: Url) -> None:
    lock = lock_url(out)
    with object_lock(_fs(), out):
        record = _record(lock)
        assert record is not None and (record.host, record.pid, record.job) == (HOST, os.getpid(), "-")
        assert not remote.exists(out)  # the lock beside the output does not make it exist
        with pytest.raises(OutputLockedError) as refused:
            with object_lock(_fs(), out):
                pytest.fail("a second writer got in")
        assert str(refused.value) == _refusal(out, f"pid {os.getpid()} on {HOST}") and refused.value.exit_code == 4
        assert _record(lock) == record  # untouched
    assert not _fs().exists(lock)


def test_the_lock_is_removed_on_any_exception(out: Url) -> None:
    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(error)), object_lock(_fs(), out):
            raise error
        assert not _fs().exists(lock_url(out))


def test_a_dead_holder_on_this_host_is_taken_over(out: Url) -> None:
    lock = lock_url(out)
    _fs().pipe_file(lock, LockRecord(HOST, _dead_pid(), 1.0, "-").text().encode())
    with object_lock(_fs(), out):
        record = _record(lock)
        assert record is not None and record.pid == os.getpid()
    assert not _fs().exists(lock)


@pytest.mark.parametrize(
    ("text", "who"),
    [
        (LockRecord("host-b", 1234, 1.0, "-").text(), "pid 1234 on host-b"),  # another host: cannot be checked
        (LockRecord(HOST, os.getppid(), 1.0, "-").text(), f"pid {os.getppid()} on {HOST}"),  # alive here
        ("", "another process"),  # unreadable
    ],
)
def test_a_live_or_uncheckable_holder_is_refused(out: Url, text: str, who: str) -> None:
    lock = lock_url(out)
    _fs().pipe_file(lock, text.encode())
    with pytest.raises(OutputLockedError) as refused, object_lock(_fs(), out):
        pytest.fail("got in")
    assert str(refused.value) == _refusal(out, who)
    assert _fs().cat_file(lock) == text.encode()  # left as it was


def test_release_removes_only_our_own_record(out: Url) -> None:
    lock = lock_url(out)
    other = LockRecord("host-b", 1234, 1.0, "-").text().encode()
    with object_lock(_fs(), out):
        _fs().pipe_file(lock, other)  # the user removed ours, another run took it
    assert _fs().cat_file(lock) == other
    _fs().rm_file(lock)

    mine = _object_lock._take(_fs(), out, lock)
    _object_lock._release(_fs(), lock, LockRecord(mine.host, mine.pid + 1, mine.since, mine.job))  # a forked child's copy
    assert _record(lock) == mine
    _object_lock._release(_fs(), lock, mine)
    assert not _fs().exists(lock)


class _NoCreateMode(MemoryFileSystem):  # type: ignore[misc]
    """A backend whose ``pipe_file`` has no ``mode`` (fsspec before 2024.12)."""

    protocol = "memory-no-create-mode"
    writes: list[str] = []

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        assert "mode" not in kwargs
        self.writes.append(path)
        super().pipe_file(path, value)


def test_without_create_mode_it_checks_then_writes(out: Url) -> None:
    fs, lock = _NoCreateMode(), lock_url(out)
    with object_lock(fs, out):
        assert fs.writes == [lock] and _record(lock) is not None
        with pytest.raises(OutputLockedError), object_lock(fs, out):
            pytest.fail("got in")
        assert len(fs.writes) == 1  # it saw the lock and wrote nothing
    assert not fs.exists(lock)


class _FlakyRead(MemoryFileSystem):  # type: ignore[misc]
    """A backend whose first read fails (a read-back after the create)."""

    protocol = "memory-flaky-read"
    reads = 0

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        self.reads += 1
        if self.reads == 1:
            raise OSError(errno.EIO, "flaky")
        return bytes(super().cat_file(path, *args, **kwargs))


def test_a_failed_read_back_of_our_own_create_still_holds_it(out: Url) -> None:
    fs = _FlakyRead()
    with object_lock(fs, out):
        record = _record(lock_url(out))
        assert fs.reads == 1 and record is not None and record.pid == os.getpid()  # the read-back failed
    assert not fs.exists(lock_url(out))


class _S3Answer(MemoryFileSystem):  # type: ignore[misc]
    """A backend whose create fails as s3fs fails it: an OSError caused by a botocore-like ClientError."""

    protocol = "memory-s3-answer"
    code = ""

    def exists(self, path: str, **kwargs: Any) -> bool:
        return False  # a create racing past the existence check

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        cause = Exception(self.code)
        cause.response = {"Error": {"Code": self.code}}  # type: ignore[attr-defined]
        raise OSError(errno.EINVAL, self.code) from cause


@pytest.mark.parametrize("code", ["PreconditionFailed", "ConditionalRequestConflict"])
def test_an_s3_create_that_lost_is_a_refusal(out: Url, code: str) -> None:
    fs = _S3Answer()
    fs.code = code
    MemoryFileSystem().pipe_file(lock_url(out), LockRecord("host-b", 7, 1.0, "-").text().encode())
    with pytest.raises(OutputLockedError, match="pid 7 on host-b"), object_lock(fs, out):
        pytest.fail("got in")


def test_another_create_failure_is_a_write_error(out: Url) -> None:
    fs = _S3Answer()
    fs.code = "AccessDenied"
    with pytest.raises(OutputWriteError, match=r"cannot create memory://.*/\.full\.pt\.lock: .*AccessDenied"):
        with object_lock(fs, out):
            pytest.fail("got in")


def test_staged_upload_holds_the_lock_for_the_whole_block(out: Url) -> None:
    lock = lock_url(out)
    with local_output(out, overwrite=False, shared=False, last=()) as (local, _):
        assert _record(lock) is not None and not remote.exists(out)
        with pytest.raises(OutputLockedError, match="is being written by pid"):
            with local_output(out, overwrite=True, shared=False, last=()):
                pytest.fail("got in")
        local.write_bytes(b"whole")
    assert _fs().cat_file(out) == b"whole" and not _fs().exists(lock)
    with pytest.raises(InvalidOptionError, match="name a path inside the bucket"):
        with local_output("memory://a-bucket-itself", overwrite=False, shared=False, last=()):
            pytest.fail("got in")
