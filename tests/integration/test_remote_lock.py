"""One writer per object-storage output, through real processes against moto's S3 server: a second
run on the same s3:// OUT is refused (exit 4, naming the holder) and uploads nothing; a dead
holder's lock on this host is taken over, one on another host refused; the lock object is gone
after every run, failed or interrupted ones included.

A run is paused mid-write by test_one_writer's ``sitecustomize`` hook (``pause``), its lock held.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from pathlib import Path

import pytest

import fsdp_convert
from fsdp_convert import remote
from fsdp_convert.errors import OutputLockedError, OutputWriteError
from fsdp_convert.remote import Url
from fsdp_convert.writers._object_lock import lock_url, object_lock
from tests._samples import Sample
from tests.integration.test_object_storage import _S3, s3  # noqa: F401  (the moto server fixture)
from tests.integration.test_one_writer import WAIT_S, _kill, _run, _start, _wait_paused, pause  # noqa: F401
from tests.unit.test_writers_lock import _dead_pid

pytestmark = pytest.mark.slow

HOST = socket.gethostname()


def _out(name: str) -> Url:
    return Url(f"s3://bucket/lock-{uuid.uuid4().hex[:8]}/{name}")


def _objects(url: Url) -> dict[str, bytes]:
    """Every object in ``url``'s folder (the output's and its lock's), by name relative to that folder."""
    fs = remote.filesystem("s3")
    fs.invalidate_cache()
    folder = url.rsplit("/", 1)[0].removeprefix("s3://")
    return {p[len(folder) + 1 :]: fs.cat_file(p) for p in fs.find(folder)}


def _writes(server: _S3) -> list[str]:
    """Paths of the requests that write or delete objects (PUT, POST, DELETE), in order."""
    return [path for method, path, _ in server.requests if method in {"PUT", "POST", "DELETE"}]


def _refusal(url: Url, who: str) -> str:
    lock = lock_url(url)
    return f"error: {url} is being written by {who} (lock {lock}); wait for it, or remove the lock if that process is gone"


def _local_bytes(sample: Sample, tmp_path: Path) -> bytes:
    single = tmp_path / "single.pt"
    fsdp_convert.consolidate(sample.checkpoint, single, nproc=1)
    return single.read_bytes()


def test_a_second_run_on_the_same_url_is_refused_and_uploads_nothing(
    s3: _S3,  # noqa: F811
    ws3_ckpt: Sample,
    tmp_path: Path,
    pause: tuple[dict[str, str], Path],  # noqa: F811
) -> None:
    paused_env, folder = pause
    env = {**paused_env, **s3.env}
    url = _out("full.pt")
    args = ["consolidate", str(ws3_ckpt.checkpoint), url]
    first = _start(args, env)
    try:
        _wait_paused(folder, [first], 1)
        before = _objects(url)
        assert list(before) == [".full.pt.lock"]  # the lock alone: nothing is uploaded before the output is whole
        assert before[".full.pt.lock"].decode().startswith(f"{HOST} {first.pid} ")
        s3.requests.clear()
        second = _run(args, {**env, "PYTHONPATH": os.getcwd()})  # not paused
        assert second.returncode == 4, second.stderr
        assert second.stdout == ""
        assert second.stderr.splitlines() == [_refusal(url, f"pid {first.pid} on {HOST}")]
        assert _writes(s3) == [] and _objects(url) == before  # wrote nothing, the lock untouched
        (folder / "go").touch()
        _, stderr = first.communicate(timeout=WAIT_S)
    finally:
        _kill([first])
    assert first.returncode == 0, stderr
    assert _objects(url) == {"full.pt": _local_bytes(ws3_ckpt, tmp_path)}  # the output whole, the lock gone


def test_a_dead_holders_lock_is_taken_over_one_on_another_host_refused(s3: _S3, ws3_ckpt: Sample, tmp_path: Path) -> None:  # noqa: F811
    fs = remote.filesystem("s3")
    url = _out("full.pt")
    lock = lock_url(url)
    args = ["consolidate", str(ws3_ckpt.checkpoint), url]
    env = {**os.environ, **s3.env, "OMP_NUM_THREADS": "1"}

    other = b"host-b 1234 1700000000.000 -\n"
    fs.pipe_file(lock, other)
    s3.requests.clear()
    refused = _run(args, env)
    assert refused.returncode == 4, refused.stderr
    assert refused.stderr.splitlines() == [_refusal(url, "pid 1234 on host-b")]
    assert _writes(s3) == [] and _objects(url) == {".full.pt.lock": other}  # wrote nothing

    fs.pipe_file(lock, f"{HOST} {_dead_pid()} 1700000000.000 -\n".encode())
    done = _run(args, env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert _objects(url) == {"full.pt": _local_bytes(ws3_ckpt, tmp_path)}


def test_the_create_is_exclusive_on_s3_past_the_existence_check(
    s3: _S3,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runs that both find no lock: moto refuses the second ``If-None-Match: *`` PUT (412)."""
    fs = remote.filesystem("s3")
    url = _out("full.pt")
    lock = lock_url(url)
    holder = b"host-b 1234 1700000000.000 -\n"
    fs.pipe_file(lock, holder, mode="create")
    monkeypatch.setattr(fs, "exists", lambda path: False)  # as if it checked before the other created it
    s3.requests.clear()
    with pytest.raises(OutputLockedError, match="pid 1234 on host-b"), object_lock(fs, url):
        pytest.fail("got in")
    assert _writes(s3) == ["/" + lock.removeprefix("s3://")]  # its create, refused
    assert _objects(url) == {".full.pt.lock": holder}


def test_the_lock_is_removed_after_a_failed_run(s3: _S3, ws3_ckpt: Sample, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A bad option found after the lock is taken (CLI), and an upload failing mid-way through the
    waves of a folder output (in process): no lock and no object is left."""
    url = _out("full.pt")
    s3.requests.clear()
    bad = _run(["consolidate", str(ws3_ckpt.checkpoint), url, "--lora-only"], {**os.environ, **s3.env})
    assert bad.returncode == 2 and "--lora-only writes a PEFT adapter folder" in bad.stderr, bad.stderr
    lock_key = "/" + lock_url(url).removeprefix("s3://")
    assert _writes(s3) == [lock_key, lock_key]  # taken (PUT), then removed (DELETE)
    assert _objects(url) == {}

    url = _out("hf")
    fs = remote.filesystem("s3")
    put_file, puts = fs.put_file, []

    def second_put_fails(lpath: str, rpath: str, **kwargs: object) -> None:
        puts.append(rpath)
        if len(puts) == 2:
            raise OSError("injected upload failure")
        put_file(lpath, rpath, **kwargs)

    monkeypatch.setattr(fs, "put_file", second_put_fails)
    with pytest.raises(OutputWriteError, match="injected upload failure"):
        fsdp_convert.consolidate(ws3_ckpt.checkpoint, url, nproc=1, only="model", max_shard_bytes=4096)
    assert len(puts) == 2 and _objects(url) == {}  # the first wave's object removed again, and the lock


def test_an_interrupted_run_removes_its_lock(
    s3: _S3,  # noqa: F811
    ws3_ckpt: Sample,
    pause: tuple[dict[str, str], Path],  # noqa: F811
) -> None:
    paused_env, folder = pause
    url = _out("full.pt")
    run = _start(["consolidate", str(ws3_ckpt.checkpoint), url], {**paused_env, **s3.env})
    try:
        _wait_paused(folder, [run], 1)
        assert list(_objects(url)) == [".full.pt.lock"]
        os.kill(run.pid, signal.SIGINT)  # Ctrl-C in the CLI's process
        _, stderr = run.communicate(timeout=WAIT_S)
    finally:
        _kill([run])
    assert run.returncode == 130, stderr
    assert _objects(url) == {}
