"""``--resume`` tests' shared parts: a hook that SIGKILLs a run mid-write, the uninterrupted references, output checks.

A ``sitecustomize`` hook put on the run's ``PYTHONPATH`` (as in ``test_memory.py``; the package
itself has no test hook) SIGKILLs the run's whole process group, as a preemption does: after a
number of bytes moved (``RESUME_TEST_KILL_AFTER``, half of the last write landing: a torn write;
records are logged in batches of 4 KiB there, so a batch in flight is lost too),
or as rank 0 writes what it writes last (``RESUME_TEST_KILL_AT=last``: half of a ``.pt`` file's
headers, a torn ``.metadata``, a torn HF index). A resumed output must be byte for byte what an
uninterrupted run wrote (a reshard's ``.metadata``, which holds a random ``save_id``, compared
entry by entry). Used by ``tests/integration/test_resume.py`` (one node) and
``test_resume_multinode.py`` (two agents, the user's torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fsdp_convert.formats import read_index
from tests._samples import Sample

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BUDGET = ["--memory-budget", "1MiB"]

HOOK = '''
"""Test hook (tests/integration/test_resume.py): SIGKILL this run's process group mid-write."""
import atexit, os, signal, threading

import fsdp_convert.blocks as _blocks
import fsdp_convert.move as _move
import fsdp_convert.writers._manifest as _manifest

# records logged in batches of 4 KiB (not 64 MiB): a kill at 10% of the 117 KB moved leaves some logged
_manifest.LOG_BATCH_BYTES = int(os.environ.get("RESUME_TEST_LOG_BATCH", 4096))

_AFTER = int(os.environ.get("RESUME_TEST_KILL_AFTER", "-1"))
_AT = os.environ.get("RESUME_TEST_KILL_AT", "")
_RANK = os.environ.get("RESUME_TEST_KILL_RANK")  # with KILL_AFTER: SIGKILL only this worker, not the group
_TERM = int(os.environ.get("RESUME_TEST_TERM_AFTER", "-1"))  # SIGTERM this process (the CLI's) once, and go on
_lock = threading.Lock()
_moved = [0]
_termed = [False]
_pwrite_all = _move.pwrite_all
_logged = threading.Event()  # a batch of records is logged: a kill after it leaves some to keep
_commit = _manifest.RecordLog._commit


def _commit_and_tell(self, lines, data_fds):
    _commit(self, lines, data_fds)
    if lines:
        _logged.set()


_manifest.RecordLog._commit = _commit_and_tell


def _kill():
    if _RANK is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def pwrite_all(fd, data, offset):
    with _lock:
        _moved[0] += len(data)
        over = 0 <= _AFTER < _moved[0] and _RANK in (None, os.environ.get("RANK"))
        term = 0 <= _TERM < _moved[0] and not _termed[0]
        _termed[0] = _termed[0] or term
    if term:
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption does, before its SIGKILL
    if over:
        _pwrite_all(fd, memoryview(data)[: len(data) // 2], offset)  # half of it lands: a torn write
        _logged.wait(10)  # another thread may still be fdatasync'ing the first batch (a slow disk): let it log
        _kill()
    _pwrite_all(fd, data, offset)


_move.pwrite_all = _blocks.pwrite_all = pwrite_all
if os.environ.get("RESUME_TEST_COUNT"):  # an uninterrupted run: say how many bytes this process moved
    path = os.path.join(os.environ["RESUME_TEST_COUNT"], f"moved-{os.getpid()}")
    atexit.register(lambda: open(path, "w").write(str(_moved[0])))

if _AT == "last":
    import fsdp_convert.writers.dcp as _dcp
    import fsdp_convert.writers.safetensors as _st
    import fsdp_convert.writers.torch_save as _ts

    _headers = _ts.write_torch_save_headers

    def _pwrite_parts(fd, image, at):  # a .pt file's headers: half of them, then SIGKILL
        parts = list(image.parts())
        for offset, part in parts[: len(parts) // 2]:
            os.pwrite(fd, part, at + offset)
        _kill()

    def write_torch_save_headers(*args, **kwargs):
        _ts._pwrite_parts = _pwrite_parts
        return _headers(*args, **kwargs)

    def write_metadata(folder, entries, stored, version):
        with open(os.path.join(folder, ".metadata"), "wb") as f:
            f.write(b"torn")
        _kill()

    def write_hf_index(path, shards):
        with open(path, "x") as f:
            f.write('{"metadata": ')
        _kill()

    _ts.write_torch_save_headers = write_torch_save_headers
    _dcp.write_metadata = write_metadata
    _st.write_hf_index = write_hf_index
'''


def run_env(*, logs: Path | None = None, hook: Path | None = None, kill: dict[str, str] | None = None) -> dict[str, str]:
    """A run's environment: the read log in ``logs`` (created), the hook on ``PYTHONPATH`` with its ``kill`` settings."""
    env = dict(ENV)
    if logs is not None:
        logs.mkdir(parents=True)
        env["FSDP_CONVERT_READ_LOG"] = str(logs)
    if hook is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(hook), env.get("PYTHONPATH", "")])
        env.update(kill or {})
    return env


def run_cli(
    args: list[str], *, logs: Path | None = None, hook: Path | None = None, kill: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m fsdp_convert ARGS`` in a process group of its own (``run_env``'s environment)."""
    return subprocess.run(
        [sys.executable, "-m", "fsdp_convert", *args],
        env=run_env(logs=logs, hook=hook, kill=kill),
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own process group: the hook's SIGKILL takes the run and its workers only
    )


def read_log(logs: Path) -> list[tuple[str, int]]:
    """Every chunk read: (fqn, payload length in bytes)."""
    rows = [json.loads(line) for log in logs.glob("*.jsonl") for line in log.read_text().splitlines() if line]
    return [(row[1], int(row[-1])) for row in rows]


def logged_records(manifest: Path) -> dict[tuple[str, int, int], str]:
    """The records the killed run logged as written and fsynced: (file, offset, nbytes) -> fqn."""
    out = {}
    for log in manifest.glob("records-*.jsonl"):
        for line in log.read_text().splitlines():
            try:
                file, offset, nbytes, _, fqn = json.loads(line)
            except ValueError:
                continue  # a torn last line
            out[(file, offset, nbytes)] = fqn
    return out


def output_files(out: Path) -> dict[str, bytes]:
    if out.is_file():
        return {"": out.read_bytes()}
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def same_output(got: Path, want: Path) -> None:
    a, b = output_files(got), output_files(want)
    assert sorted(a) == sorted(b)
    for name in a:
        if Path(name).name == ".metadata":  # holds a random save_id: compare what it says
            assert repr(read_index(got).entries) == repr(read_index(want).entries)
        else:
            assert a[name] == b[name], f"{name} differs"


@pytest.fixture(scope="session")
def resume_hook(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("resume-hook")
    (folder / "sitecustomize.py").write_text(HOOK)
    return folder


CASES = {
    "pt": (["consolidate", "{ck}", "{out}", "--nproc", "1", *BUDGET], "full.pt"),
    "hf": (["consolidate", "{ck}", "{out}", "--nproc", "1", "--max-shard-size", "40KB", *BUDGET], "hf"),
    "reshard": (["reshard", "{ck}", "{out}", "--world-size", "2", "--nproc", "1"], "ws2"),
}


Reference = tuple[Path, list[tuple[str, int]], int]


@pytest.fixture(scope="session")
def resume_references(ws3_ckpt: Sample, resume_hook: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Reference]:
    """Each case run uninterrupted: its output, its read log, and the most bytes one of its processes moved."""
    root = tmp_path_factory.mktemp("resume-ref")
    refs = {}
    for name, (args, out_name) in CASES.items():
        out = root / name / out_name
        counts = root / f"{name}-moved"
        counts.mkdir()
        out.parent.mkdir()
        argv = [a.format(ck=ws3_ckpt.checkpoint, out=out) for a in args]
        done = run_cli(argv, logs=root / f"{name}-reads", hook=resume_hook, kill={"RESUME_TEST_COUNT": str(counts)})
        assert done.returncode == 0, done.stderr
        # the most bytes one process moved: the hook's SIGKILL counts per process
        moved = max(int(p.read_text()) for p in counts.iterdir())
        refs[name] = (out, read_log(root / f"{name}-reads"), moved)
    return refs


def manifest_of(folder: Path) -> Path:
    """The one manifest folder in ``folder`` (beside the interrupted run's temporary)."""
    (manifest,) = [p for p in folder.iterdir() if ".manifest-" in p.name]
    return manifest


def check_rereads(
    reads: list[tuple[str, int]],
    ref: Reference,
    logged: dict[tuple[str, int, int], str],
    *,
    whole_records: bool,
    nothing_missing: bool,
) -> tuple[int, int]:
    """A resumed run read only what was missing: no more of a tensor than a whole run reads of it, less than a whole run in all.

    Args:
        reads: the resumed run's chunks read (``read_log``).
        ref: the uninterrupted run's reference.
        logged: the records the interrupted run logged (``logged_records``).
        whole_records: a record is a whole tensor (a consolidation): a kept tensor is never read again.
        nothing_missing: every record was logged: nothing may be read.

    Returns:
        The bytes read again, and the bytes an uninterrupted run reads.
    """
    read_fqns = {fqn for fqn, _ in reads}
    ref_bytes: Counter[str] = Counter()
    for fqn, nbytes in ref[1]:
        ref_bytes[fqn] += nbytes
    reread, full = sum(n for _, n in reads), sum(ref_bytes.values())
    if nothing_missing:
        assert reads == [], "every record was written and fsynced: nothing is read again"
    assert reread <= sum(ref_bytes[f] for f in read_fqns)
    assert reread < full
    if whole_records:
        again_read = read_fqns & set(logged.values())
        assert not again_read, f"read again though kept: {sorted(again_read)[:3]}"
    return reread, full
