"""``--resume`` reads only regular, bounded files from the interrupted run's manifest folder (issue 37 N11).

Before: a FIFO ``manifest.json`` blocked ``--resume`` for good, and a 2 GiB (sparse) ``manifest.json``
or ``records-0.jsonl`` was read whole (4.1 GB of memory). Each test stops a real run (SIGKILL as
rank 0 writes its last bytes, ``tests/_resume.py``'s hook), replaces one file of its manifest
folder, and resumes: refused in one line naming the file and the way forward, in bounded time
and memory. An untouched stopped run still resumes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests._resume import manifest_of, run_cli
from tests.redteam._attack import RSS_BOUND_BYTES, SECONDS_BOUND, attack

SPARSE_BYTES = 2 << 30


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory, resume_hook: Path) -> Path:
    """A folder of ``a.pt`` and ``out/``: a consolidation of it SIGKILLed before it finished (temporary and manifest left)."""
    root = tmp_path_factory.mktemp("stopped")
    torch.save({"model": {f"w{i}": torch.randn(64, 64) for i in range(8)}}, root / "a.pt")
    (root / "out").mkdir()
    done = run_cli(["consolidate", str(root / "a.pt"), str(root / "out" / "full.pt"), "--nproc", "1"], hook=resume_hook,
                   kill={"RESUME_TEST_KILL_AT": "last"})  # fmt: skip
    assert done.returncode == -9, done.stderr
    assert (manifest_of(root / "out") / "manifest.json").is_file()
    return root


def _copy(stopped: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The stopped run's output folder copied (the source stays where the manifest says); (out, manifest folder)."""
    out = Path(shutil.copytree(stopped / "out", tmp_path / "out"))
    return out / "full.pt", manifest_of(out)


def _resume(stopped: Path, out: Path) -> object:
    return attack(["consolidate", stopped / "a.pt", out, "--nproc", "1", "--resume"], timeout=15)


def _refused(result: object, name: str) -> None:
    code, seconds, rss = result.code, result.seconds, result.max_rss_bytes  # type: ignore[attr-defined]
    lines = result.error_lines  # type: ignore[attr-defined]
    assert code not in (None, 0, 70), result
    assert len(lines) == 1 and name in lines[0] and "without --resume" in lines[0], result
    assert seconds < 2 * SECONDS_BOUND and rss < RSS_BOUND_BYTES, (seconds, rss)


@pytest.mark.parametrize("name", ["manifest.json", "records-0.jsonl"])
def test_a_fifo_in_the_manifest_folder_is_refused(stopped: Path, tmp_path: Path, name: str) -> None:
    out, manifest = _copy(stopped, tmp_path)
    (manifest / name).unlink()
    os.mkfifo(manifest / name)
    _refused(_resume(stopped, out), name)


@pytest.mark.parametrize("name", ["manifest.json", "records-0.jsonl"])
def test_a_huge_sparse_file_in_the_manifest_folder_is_refused_unread(stopped: Path, tmp_path: Path, name: str) -> None:
    out, manifest = _copy(stopped, tmp_path)
    os.truncate(manifest / name, SPARSE_BYTES)  # its lines first, then 2 GiB of holes
    _refused(_resume(stopped, out), name)


def test_a_stopped_run_still_resumes(stopped: Path, tmp_path: Path) -> None:
    out, _ = _copy(stopped, tmp_path)
    result = _resume(stopped, out)
    assert result.code == 0 and out.is_file(), result  # type: ignore[attr-defined]
