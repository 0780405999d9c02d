"""One writer per output, through real processes: a second run on the same OUT is refused (exit 4,
naming the holder) and touches nothing; a multi-node job is not blocked by its own lock; a
SIGKILLed run's temporary is reported, its lock taken over; the space check fails before any read.

A run is paused mid-write by a ``sitecustomize`` hook on its ``PYTHONPATH`` (as test_memory does):
once its output files are open (the lock taken, the temporary created) it writes ``paused-<pid>``
and waits for a ``go`` file. The package itself has no test hook.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from tests._dist import free_port
from tests._samples import Sample

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WAIT_S = 120  # a run that has not paused (or exited) this long after its start has hung

HOOK = '''
"""Test hook (tests/integration/test_one_writer.py): pause a run once its output files are open."""
import functools, os, time
import fsdp_convert.ops._consolidate_rank as consolidate

_open_files = consolidate._open_files
FOLDER = os.environ["ONE_WRITER_PAUSE"]


@functools.wraps(_open_files)
def _paused(job, rank, stack):
    fds = _open_files(job, rank, stack)
    open(os.path.join(FOLDER, f"paused-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(FOLDER, "go")):
        time.sleep(0.01)
    return fds


consolidate._open_files = _paused
'''


@pytest.fixture
def pause(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """An environment whose runs pause mid-write, and the folder where they say so (touch ``go`` to let them on)."""
    hook, folder = tmp_path / "hook", tmp_path / "pause"
    hook.mkdir()
    folder.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(p for p in (str(hook), os.getcwd(), ENV.get("PYTHONPATH", "")) if p)
    yield {**ENV, "PYTHONPATH": path, "ONE_WRITER_PAUSE": str(folder)}, folder
    (folder / "go").touch()  # never leave a paused run behind


def _start(args: list[str], env: dict[str, str] = ENV) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fsdp_convert", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, killed whole
    )


def _run(args: list[str], env: dict[str, str] = ENV) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsdp_convert", *args], env=env, capture_output=True, text=True, timeout=WAIT_S)


def _wait_paused(folder: Path, procs: list[subprocess.Popen[str]], count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while len(list(folder.glob("paused-*"))) < count:
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"exited {proc.returncode} before pausing: {proc.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, "the run did not pause"
        time.sleep(0.02)


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_a_second_run_on_the_same_output_is_refused(ws3_ckpt: Sample, tmp_path: Path, pause: tuple[dict[str, str], Path]) -> None:
    env, folder = pause
    outdir = tmp_path / "out"
    outdir.mkdir()
    out = outdir / "full.pt"
    args = ["consolidate", str(ws3_ckpt.checkpoint), str(out)]
    first = _start(args, env)
    try:
        _wait_paused(folder, [first], 1)
        before, lock_text = _listing(outdir), (outdir / ".full.pt.lock").read_text()
        assert {".full.pt.lock", ".full.tmp-local.pt"} <= set(before)
        second = _run(args)
        assert second.returncode == 4, second.stderr
        assert second.stdout == ""
        assert second.stderr.splitlines() == [
            f"error: {out} is being written by pid {first.pid} on {socket.gethostname()} (lock .full.pt.lock); "
            "wait for it, or remove the lock if that process is gone"
        ]
        assert _listing(outdir) == before and (outdir / ".full.pt.lock").read_text() == lock_text  # touched nothing
        (folder / "go").touch()
        stdout, stderr = first.communicate(timeout=WAIT_S)
    finally:
        _kill([first])
    assert first.returncode == 0, stderr
    single = tmp_path / "single.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, single, nproc=1)
    assert out.read_bytes() == single.read_bytes()
    assert sorted(p.name for p in outdir.iterdir()) == ["full.pt"]  # no lock, no temporary left


def _node(node_rank: int, port: int, run_id: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    cluster = ["--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1"]
    return _start([*args, *cluster, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id], env)


def test_a_multi_node_job_shares_its_lock_and_refuses_another_job(
    ws3_ckpt: Sample, tmp_path: Path, pause: tuple[dict[str, str], Path]
) -> None:
    """Two agents of job-a both get past the lock (each pauses in its worker, output files open);
    a node of job-b on the same OUT is refused at once, before its rendezvous."""
    env, folder = pause
    outdir = tmp_path / "out"
    outdir.mkdir()
    out = outdir / "full.pt"
    args = ["consolidate", str(ws3_ckpt.checkpoint), str(out)]
    port = free_port()
    nodes = [_node(rank, port, "job-a", args, env) for rank in (0, 1)]
    try:
        _wait_paused(folder, nodes, 2)
        assert {".full.pt.lock", ".full.tmp-rdzv-job-a.pt"} <= set(_listing(outdir))
        holder = (outdir / ".full.pt.lock").read_text().split()
        assert holder[3] == "rdzv-job-a" and int(holder[1]) in {n.pid for n in nodes}
        other = _node(0, free_port(), "job-b", args, ENV)
        _, stderr = other.communicate(timeout=WAIT_S)
        assert other.returncode == 4, stderr
        assert stderr.splitlines() == [
            f"error: {out} is being written by pid {holder[1]} on {socket.gethostname()} (lock .full.pt.lock); "
            "wait for it, or remove the lock if that process is gone"
        ]
        (folder / "go").touch()
        results = [node.communicate(timeout=WAIT_S) for node in nodes]
    finally:
        _kill(nodes)
    for node, (_, stderr) in zip(nodes, results, strict=True):
        assert node.returncode == 0, stderr
    single = tmp_path / "single.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, single, nproc=1)
    assert out.read_bytes() == single.read_bytes()
    assert sorted(p.name for p in outdir.iterdir()) == ["full.pt"]


def test_a_killed_runs_temporary_is_reported_and_its_lock_taken_over(
    ws3_ckpt: Sample, tmp_path: Path, pause: tuple[dict[str, str], Path]
) -> None:
    env, folder = pause
    outdir = tmp_path / "out"
    outdir.mkdir()
    out, tmp, lock = outdir / "full.pt", outdir / ".full.tmp-local.pt", outdir / ".full.pt.lock"
    args = ["consolidate", str(ws3_ckpt.checkpoint), str(out)]
    killed = _start(args, env)
    try:
        _wait_paused(folder, [killed], 1)
    finally:
        _kill([killed])  # SIGKILL mid-write: its flock goes with it, its files stay
    before = _listing(outdir)
    assert {lock.name, tmp.name} <= set(before)
    stale_lock = lock.read_text()

    again = _run(args)
    assert again.returncode == 4, again.stderr
    lines = again.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp} is left from an earlier run writing full.pt ("), lines
    assert lines[0].endswith(" s old); pass --resume to continue it, or remove it"), lines
    after = _listing(outdir)
    assert lock.name not in after  # the dead run's lock taken over silently, then let go
    assert after == {name: seen for name, seen in before.items() if name != lock.name}  # the rest left alone

    for left in outdir.iterdir():
        shutil.rmtree(left) if left.is_dir() else left.unlink()
    lock.write_text(stale_lock)  # the killed run's lock alone: its holder is gone, so it is taken over silently
    done = _run(args)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    single = tmp_path / "single.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, single, nproc=1)
    assert out.read_bytes() == single.read_bytes()
    assert sorted(p.name for p in outdir.iterdir()) == ["full.pt"]


class _Statvfs:
    """What ``os.statvfs`` returns, as far as the space check reads it."""

    def __init__(self, free_bytes: int) -> None:
        self.f_frsize = 4096
        self.f_bavail = free_bytes // self.f_frsize


FREE_BYTES = 40960  # "41.0 kB"; every output of the sample is larger
SPACE_CASES = {  # command, output name, temporary name, extra options
    "consolidate-pt": ("consolidate", "full.pt", ".full.tmp-local.pt", []),
    "consolidate-hf": ("consolidate", "hf", ".hf.tmp-local", ["--only", "model"]),
    "reshard": ("reshard", "resharded", ".resharded.tmp-local", ["--world-size", "2"]),
}


def _no_space_line(shown: str, where: str, why: str) -> str:
    return (
        rf"error: cannot write {re.escape(shown)}: No space left on device: it needs [\d.]+ [kMG]?B but "
        rf"{re.escape(where)} has [\d.]+ [kMG]?B free \({re.escape(why)}\); free space or pass --no-space-check"
    )


def _reads(logs: Path) -> list[str]:
    return [line for log in logs.iterdir() for line in log.read_text().splitlines()]


@pytest.mark.parametrize("case", sorted(SPACE_CASES))
def test_the_space_check_fails_before_any_read(
    case: str, runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command, name, tmp_name, extra = SPACE_CASES[case]
    logs, outdir = tmp_path / "reads", tmp_path / "out"
    logs.mkdir()
    outdir.mkdir()
    out = outdir / name
    monkeypatch.setenv("FSDP_CONVERT_READ_LOG", str(logs))
    monkeypatch.setattr(os, "statvfs", lambda path: _Statvfs(FREE_BYTES))
    result = runner.invoke(app, [command, str(ws3_ckpt.checkpoint), str(out), *extra])
    assert result.exit_code == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        _no_space_line(str(out), str(outdir), f"its temporary {tmp_name} is written there"), lines[0]
    )
    assert "41.0 kB free" in lines[0]
    assert list(outdir.iterdir()) == [] and _reads(logs) == []  # nothing created, nothing read

    result = runner.invoke(app, [command, str(ws3_ckpt.checkpoint), str(out), *extra, "--no-space-check"])
    assert result.exit_code == 0, result.stderr
    assert [p.name for p in outdir.iterdir()] == [name] and _reads(logs)


def test_the_space_check_counts_a_remote_outputs_staging_folder(
    runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    monkeypatch.setattr(os, "statvfs", lambda path: _Statvfs(FREE_BYTES))
    url = f"memory://one-writer-{os.getpid()}/full.pt"
    result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), url])
    assert result.exit_code == 1, result.stderr
    lines = result.stderr.splitlines()
    why = "its local copy is written there, then uploaded; set TMPDIR to a larger folder"
    assert len(lines) == 1 and re.fullmatch(
        _no_space_line(url, str(staging), why).replace(
            re.escape(str(staging)), re.escape(str(staging)) + r"/fsdp-convert-upload-\w+"
        ),
        lines[0],
    ), lines
    assert list(staging.iterdir()) == []  # the staging folder removed


def _under_a_64kib_file_size_limit() -> None:  # preexec_fn: RLIMIT_FSIZE, where mounting is not allowed
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_the_space_check_on_a_tiny_filesystem(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """A real 64 KiB tmpfs as root (CI), or a 64 KiB RLIMIT_FSIZE where mounting is not allowed: the
    run fails at once, reads nothing and leaves nothing behind."""
    mount, logs = tmp_path / "tiny", tmp_path / "reads"
    mount.mkdir()
    logs.mkdir()
    out = mount / "full.pt"
    env = {**ENV, "FSDP_CONVERT_READ_LOG": str(logs)}
    if os.geteuid() != 0:
        run = subprocess.run(
            [sys.executable, "-m", "fsdp_convert", "consolidate", str(ws3_ckpt.checkpoint), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            preexec_fn=_under_a_64kib_file_size_limit,
        )
        assert run.returncode == 1, run.stderr
        lines = run.stderr.splitlines()
        assert len(lines) == 1 and "File too large" in lines[0] and "RLIMIT_FSIZE" in lines[0], lines
        assert list(mount.iterdir()) == [] and _reads(logs) == []
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True)
    assert mounted.returncode == 0, f"root cannot mount a tmpfs here: {mounted.stderr.strip()}"
    try:
        run = _run(["consolidate", str(ws3_ckpt.checkpoint), str(out)], env)
        assert run.returncode == 1, run.stderr
        lines = run.stderr.splitlines()
        assert len(lines) == 1 and re.fullmatch(
            _no_space_line(str(out), str(mount), "its temporary .full.tmp-local.pt is written there"), lines[0]
        )
        assert list(mount.iterdir()) == [] and _reads(logs) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_file_output_must_fit_the_file_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RLIMIT_FSIZE check itself, whoever runs the suite: a .pt over the limit is refused, a folder's files are not summed."""
    from fsdp_convert.errors import OutputWriteError
    from fsdp_convert.writers import _space

    monkeypatch.setattr(_space.resource, "getrlimit", lambda _: (64 * 1024, resource.RLIM_INFINITY))
    with pytest.raises(OutputWriteError, match=r"File too large: it needs 100\.0 kB .*RLIMIT_FSIZE"):
        _space.check_space(tmp_path / "full.pt", 100_000, directory=False, tag=None)
    _space.check_space(tmp_path / "hf", 100_000, directory=True, tag=None)
