"""Interrupted and killed runs leave no output: SIGINT, SIGTERM, SIGKILL, and a worker that dies.

These runs are resumable (one node, a local output): Ctrl-C, SIGTERM and a dead worker keep the
hidden temporary and its manifest for ``--resume`` (test_resume.py finishes them), say so on the
one error line, and release the lock; ``OUT`` never appears.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdp_convert._sample import CHECKPOINT_DIRNAME

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HANG_S = 120  # a run that takes longer than this to exit after the act has hung (a loaded CI box takes seconds)


def _start(ck: Path, out: Path, nproc: int, log_dir: Path | None = None) -> subprocess.Popen[str]:
    # a small budget and --verify keep the run going long enough to be interrupted mid-write
    args = ["consolidate", str(ck), str(out), "--nproc", str(nproc), "--memory-budget", "1MiB", "--verify"]
    return subprocess.Popen(
        [sys.executable, "-m", "fsdp_convert", *args],
        env={**ENV, "FSDP_CONVERT_READ_LOG": str(log_dir)} if log_dir else ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a hung run is killed with its workers
    )


def _finish(proc: subprocess.Popen[str], timeout: float = HANG_S) -> tuple[str, str]:
    """Wait for the run to exit; a run still going after ``timeout`` seconds has hung: kill it and fail."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"the run was still going {timeout:.0f} s later: it hung") from None


def _temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if ".tmp-" in p.name]


def _wait_until_writing(proc: subprocess.Popen[str], folder: Path, timeout: float = 120) -> None:
    """Until the run's temporary and its manifest are there (rank 0's worker writes the manifest once it has opened the files)."""
    deadline = time.monotonic() + timeout
    while not (_temporaries(folder) and list(folder.glob(".*.manifest-*/manifest.json"))):
        if proc.poll() is not None:
            raise _Missed  # finished before its temporary was seen
        assert time.monotonic() < deadline, "no temporary output appeared"
        time.sleep(0.002)


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        found += kids
        frontier += kids
    return found


def _worker_of_rank(log_dir: Path, rank: int) -> int:
    """The worker process of ``rank``, from the read log it writes (``reads-<pid>.jsonl``, one line per chunk, rank first)."""
    for log in log_dir.glob("reads-*.jsonl"):
        first = log.read_text().split("\n", 1)[0]
        if first and json.loads(first)[0] == str(rank):
            return int(log.stem.removeprefix("reads-"))
    raise AssertionError(f"rank {rank} has not read a chunk yet")


class _Missed(Exception):
    """The run was past writing before it could be interrupted (a loaded machine): let it finish, try again."""


def _interrupted_run(
    ck: Path, folder: Path, nproc: int, act: Callable[[subprocess.Popen[str]], None], log_dir: Path | None = None
) -> tuple[int, str, str, float]:
    """Start a run, act on it once it is writing, and return (exit code, stdout, stderr, seconds from act to exit).

    Only a run that exited 0 (it completed before the act could land) is tried again, up to three
    times. A run that exited otherwise, by a signal or an error, is returned, and fails here at
    once if it left anything at ``OUT``: that is the claim under test.
    """
    out = folder / "full.pt"
    for _ in range(3):
        for leftover in folder.iterdir():  # a kept temporary's manifest is a folder
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
            log_dir.mkdir()
        proc = _start(ck, out, nproc, log_dir)
        acted = time.monotonic()
        try:
            _wait_until_writing(proc, folder)
            act(proc)
            acted = time.monotonic()
        except _Missed:
            pass  # not acted on: it exits by itself
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)  # never leave a run behind
            proc.communicate()
            raise
        stdout, stderr = _finish(proc)
        seconds = time.monotonic() - acted
        if proc.returncode == 0:
            continue  # finished (the output complete and in place) before the act landed
        assert not out.exists(), f"exit {proc.returncode} left {out} in place; stderr: {stderr}"
        return proc.returncode, stdout, stderr, seconds
    raise AssertionError("the run finished before it could be interrupted, three times")


KEPT = [".full.manifest-local.pt", ".full.tmp-local.pt"]  # the temporary and its manifest; no lock, no full.pt


def _says_kept(line: str, folder: Path) -> None:
    """The error line names the kept temporary, how much of it is written, and ``--resume``."""
    assert f"; the temporary {folder / KEPT[1]} (" in line, line
    assert line.endswith(" written) is kept: run again with --resume to finish it, or remove it"), line


@pytest.mark.parametrize(("sig", "nproc", "code"), [(signal.SIGINT, 1, 130), (signal.SIGTERM, 1, 143), (signal.SIGTERM, 2, 143)])
def test_signal_mid_write_keeps_the_temporary_for_resume(
    big_sample: Path, tmp_path: Path, sig: int, nproc: int, code: int
) -> None:
    returncode, stdout, stderr, _ = _interrupted_run(
        big_sample / CHECKPOINT_DIRNAME, tmp_path, nproc, lambda p: p.send_signal(sig)
    )
    assert returncode == code, stderr
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: interrupted ({signal.Signals(sig).name}); "), stderr
    _says_kept(lines[0], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == KEPT


def test_sigkill_mid_write_leaves_no_output(big_sample: Path, tmp_path: Path) -> None:
    returncode, _, _, _ = _interrupted_run(big_sample / CHECKPOINT_DIRNAME, tmp_path, 1, lambda p: p.kill())
    assert returncode == -signal.SIGKILL
    assert not (tmp_path / "full.pt").exists()  # only a hidden temporary may remain; nothing looks complete


def test_dead_worker_fails_the_job_within_seconds(big_sample: Path, tmp_path: Path) -> None:
    """The job fails, naming the dead rank, and keeps the temporary for --resume. How soon is reported, not asserted
    (a loaded 2-core CI box can take many seconds): a run still going HANG_S later fails as hung."""

    logs = tmp_path.parent / f"{tmp_path.name}-reads"

    def kill_worker(proc: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                pid = _worker_of_rank(logs, 1)
                break
            except AssertionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise _Missed from None
                time.sleep(0.002)
        if not _temporaries(tmp_path):
            raise _Missed  # the writing is over
        os.kill(pid, signal.SIGKILL)

    returncode, _, stderr, seconds = _interrupted_run(big_sample / CHECKPOINT_DIRNAME, tmp_path, 2, kill_worker, logs)
    print(f"\nthe job failed {seconds:.1f} s after its worker was killed")
    assert returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "worker rank 1" in lines[0], stderr
    _says_kept(lines[0], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == KEPT
