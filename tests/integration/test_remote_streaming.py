"""Folder outputs to object storage go up in waves of files: the local staging folder holds two waves, never the whole output.

The staging folder is a small tmpfs (mounted here; the tests run as root), smaller than the output,
and the waves are made small (``ops._waves.WAVE_BYTES``), so a run that staged the whole output
would fail for want of space; the peak staged is also measured before each upload.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

import fsdp_convert
from fsdp_convert import remote
from fsdp_convert.ops import _waves
from fsdp_convert.output_table import HF_INDEX_FILENAME, METADATA_FILENAME
from fsdp_convert.writers import _staging
from tests._samples import Sample
from tests.integration.test_object_storage import _S3, s3  # noqa: F401  (the moto server fixture)

pytestmark = pytest.mark.slow

SHARD_BYTES = 4096  # the 3-rank sample's model (41 kB) in about 11 shards


@pytest.fixture
def staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], Path]]:
    """Mount a tmpfs of the given size (bytes) as the folder remote outputs are staged in (``_staging``'s ``mkdtemp`` only).

    Without root (CI runs as root) the folder is not capped; the staging peak the tests measure
    (``_staged_peak``) still bounds what the run held there."""
    folder = tmp_path / "staging"
    folder.mkdir()

    def mount(size_bytes: int) -> Path:
        if os.geteuid() == 0:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)], capture_output=True, text=True
            )
            assert done.returncode == 0, f"root cannot mount a tmpfs here: {done.stderr.strip()}"
        monkeypatch.setattr(_staging, "tempfile", SimpleNamespace(mkdtemp=partial(tempfile.mkdtemp, dir=folder)))
        return folder

    yield mount
    if folder.is_mount():
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def _staged_peak(monkeypatch: pytest.MonkeyPatch, folder: Path) -> list[int]:
    """Record the bytes in ``folder`` as each wave's upload starts (the most a run holds: two waves)."""
    peaks: list[int] = []
    put = remote._put_and_remove

    def measured(local: Path, url: remote.Url, names: tuple[str, ...], done: list[str]) -> int:
        peaks.append(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()))
        return put(local, url, names, done)

    monkeypatch.setattr(remote, "_put_and_remove", measured)
    return peaks


def _bucket_files(url: str) -> dict[str, bytes]:
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return {p[len(url.removeprefix("s3://")) + 1 :]: fs.cat_file(p) for p in fs.find(url)}


def _uploads(server: _S3) -> list[str]:
    """Object paths written, in order (one PUT each for files this small)."""
    return [path for method, path, _ in server.requests if method == "PUT"]


def test_hf_folder_goes_up_shard_by_shard(
    s3: _S3,  # noqa: F811
    ws3_ckpt: Sample,
    tmp_path: Path,
    staging: Callable[[int], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = tmp_path / "hf"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, local, nproc=1, only="model", max_shard_bytes=SHARD_BYTES)
    want = {p.name: p.read_bytes() for p in local.iterdir()}
    total = sum(map(len, want.values()))
    assert len(want) >= 9 and total > 32 << 10  # more than the staging folder holds
    monkeypatch.setattr(_waves, "WAVE_BYTES", 2 * SHARD_BYTES)
    folder = staging(32 << 10)
    peaks = _staged_peak(monkeypatch, folder)
    s3.requests.clear()

    url = "s3://bucket/waves/hf"
    result = fsdp_convert.consolidate(ws3_ckpt.checkpoint, url, nproc=2, only="model", max_shard_bytes=SHARD_BYTES)

    assert _bucket_files(url) == want  # byte for byte a local consolidation
    assert result.file_bytes == total and str(result.output) == url
    assert len(peaks) >= 4 and max(peaks) < total // 2
    lock, *puts = _uploads(s3)
    assert lock == "/bucket/waves/.hf.lock"  # the output's lock object, created first (deleted at the end)
    assert len(puts) == len(want) and puts[-1].endswith(HF_INDEX_FILENAME)  # each file once, the index last
    assert not list(folder.iterdir())


def test_reshard_rank_files_go_up_one_by_one(
    s3: _S3,  # noqa: F811
    ws3_ckpt: Sample,
    tmp_path: Path,
    staging: Callable[[int], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = tmp_path / "ws8"
    fsdp_convert.reshard(ws3_ckpt.checkpoint, local, world_size=8, nproc=1)
    rank_files = {p.name: p.stat().st_size for p in local.iterdir() if p.suffix == ".distcp"}
    total = sum(rank_files.values())
    assert len(rank_files) == 8 and total > 1 << 20
    monkeypatch.setattr(_waves, "WAVE_BYTES", 1)  # one rank file a wave
    folder = staging(512 << 10)  # two rank files and .metadata, not the output
    peaks = _staged_peak(monkeypatch, folder)
    s3.requests.clear()

    url = "s3://bucket/waves/ws8"
    result = fsdp_convert.reshard(ws3_ckpt.checkpoint, url, world_size=8, nproc=2)

    got = _bucket_files(url)
    assert {name: len(data) for name, data in got.items() if name != METADATA_FILENAME} == rank_files
    assert result.file_bytes == sum(map(len, got.values()))
    assert len(peaks) == 8 and max(peaks) < total // 2
    assert _uploads(s3)[-1].endswith(METADATA_FILENAME)
    assert not list(folder.iterdir())
    a, b = tmp_path / "from_s3.pt", tmp_path / "from_local.pt"
    fsdp_convert.consolidate(url, a)
    fsdp_convert.consolidate(local, b)
    assert a.read_bytes() == b.read_bytes()
