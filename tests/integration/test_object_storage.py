"""Checkpoints and outputs on an S3-compatible server on loopback (moto's server, started here)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fsdp_convert
from fsdp_convert import remote
from fsdp_convert.formats import read_index
from tests._samples import Sample

pytestmark = pytest.mark.slow


class _S3:
    """A moto S3 server on 127.0.0.1 whose every request is logged: (method, path, Range header)."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self.requests: list[tuple[str, str, str | None]] = []
        app = DomainDispatcherApplication(create_backend_app)

        def logged(environ: dict[str, Any], start_response: Any) -> Any:
            self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE")))
            return app(environ, start_response)

        self.server = make_server("127.0.0.1", 0, logged, threaded=True)
        self.env = {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{self.server.server_port}",
        }
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def s3() -> Iterator[_S3]:
    server = _S3()
    old = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)  # for this process's fsspec and the workers it starts
    import fsspec
    import fsspec.config

    # fsspec reads FSSPEC_<PROTOCOL>_<OPTION> into its config only when first imported; another test
    # module (torchtitan, datasets) may have imported it already in this process, so apply them now
    saved_conf = copy.deepcopy(fsspec.config.conf)
    fsspec.config.set_conf_env(fsspec.config.conf)
    remote._filesystem.cache_clear()  # a filesystem another module's server made points at its (closed) port
    fsspec.filesystem("s3").makedirs("bucket", exist_ok=True)  # moto's store is per process: another module's server made it
    yield server
    remote._filesystem.cache_clear()
    server.server.shutdown()
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved_conf)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_convert", *args],
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_consolidate_from_and_to_s3_matches_local(s3: _S3, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Upload a 3-rank checkpoint, consolidate it with 2 workers into the bucket, compare with the
    local result byte for byte. Every read of a data file is a ranged GET of one payload."""
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.put(str(ws3_ckpt.checkpoint) + "/", "s3://bucket/ck/", recursive=True)
    s3.requests.clear()
    proc = _cli("consolidate", "s3://bucket/ck", "s3://bucket/out/full.pt", "--nproc", "2", env=s3.env)
    assert proc.returncode == 0, proc.stderr
    local = tmp_path / "full.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, local, nproc=1)
    assert fs.cat_file("s3://bucket/out/full.pt") == local.read_bytes()

    index = read_index(ws3_ckpt.checkpoint)
    payloads = {(c.relative_path, c.offset_bytes, c.length_bytes) for e in index.tensors() for c in e.chunks if c.relative_path}
    payloads |= {(e.relative_path, e.offset_bytes, e.length_bytes) for e in index.entries if not hasattr(e, "chunks")}
    data_gets = [(path, rng) for method, path, rng in s3.requests if method == "GET" and path.endswith(".distcp")]
    assert data_gets and all(rng is not None for _, rng in data_gets), "a data file was downloaded whole"
    fetched = set()
    for path, rng in data_gets:
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
        assert m, rng
        start, end = int(m.group(1)), int(m.group(2)) + 1
        fetched.add((path.rsplit("/", 1)[-1], start, end - start))
    assert fetched <= payloads  # exactly payload ranges, nothing else
    assert sum(n for *_, n in fetched) <= sum(fs.size(f"s3://bucket/ck/{f}") for f in index.data_files)

    # the output exists now: a second run refuses before reading anything
    proc = _cli("consolidate", "s3://bucket/ck", "s3://bucket/out/full.pt", env=s3.env)
    assert (
        proc.returncode == 4
        and proc.stderr.strip() == "error: s3://bucket/out/full.pt already exists; pass --overwrite to replace it"
    )


def test_reshard_to_s3_and_back(s3: _S3, ws3_ckpt: Sample, tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.put(str(ws3_ckpt.checkpoint) + "/", "s3://bucket/ck2/", recursive=True)
    fsdp_convert.reshard("s3://bucket/ck2", "s3://bucket/out/ws2", world_size=2)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("s3://bucket/out/ws2")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    fsdp_convert.consolidate("s3://bucket/out/ws2", a)
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, b)
    assert a.read_bytes() == b.read_bytes()
