"""``--resume`` after a SIGKILL: real processes, real signals; the output is byte-identical and only the missing records are read.

A ``sitecustomize`` hook put on the run's ``PYTHONPATH`` (as in ``test_memory.py``; the package
itself has no test hook) SIGKILLs the run's whole process group, as a preemption does: after a
number of bytes moved (``RESUME_TEST_KILL_AFTER``, half of the last write landing: a torn write),
or as rank 0 writes what it writes last (``RESUME_TEST_KILL_AT=last``: half of a ``.pt`` file's
headers, a torn ``.metadata``, a torn HF index). The rerun with ``--resume`` must finish with the
output byte for byte as an uninterrupted run wrote it (a reshard's ``.metadata``, which holds a
random ``save_id``, compared entry by entry), and read (the read log, ``FSDP_CONVERT_READ_LOG``)
only chunks of the tensors whose records were missing, at most what the uninterrupted run read
for them. Each case prints a row of the fault table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fsdp_convert.formats import read_index
from tests._samples import Sample

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BUDGET = ["--memory-budget", "1MiB"]

HOOK = '''
"""Test hook (tests/integration/test_resume.py): SIGKILL this run's process group mid-write."""
import atexit, os, signal, threading

import fsdp_convert.blocks as _blocks
import fsdp_convert.move as _move

_AFTER = int(os.environ.get("RESUME_TEST_KILL_AFTER", "-1"))
_AT = os.environ.get("RESUME_TEST_KILL_AT", "")
_RANK = os.environ.get("RESUME_TEST_KILL_RANK")  # with KILL_AFTER: SIGKILL only this worker, not the group
_TERM = int(os.environ.get("RESUME_TEST_TERM_AFTER", "-1"))  # SIGTERM this process (the CLI's) once, and go on
_lock = threading.Lock()
_moved = [0]
_termed = [False]
_pwrite_all = _move.pwrite_all


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


def _run(
    args: list[str], *, logs: Path | None = None, hook: Path | None = None, kill: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(ENV)
    if logs is not None:
        logs.mkdir(parents=True)
        env["FSDP_CONVERT_READ_LOG"] = str(logs)
    if hook is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(hook), env.get("PYTHONPATH", "")])
        env.update(kill or {})
    return subprocess.run(
        [sys.executable, "-m", "fsdp_convert", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own process group: the hook's SIGKILL takes the run and its workers only
    )


def _reads(logs: Path) -> list[tuple[str, int]]:
    """Every chunk read: (fqn, payload length in bytes)."""
    rows = [json.loads(line) for log in logs.glob("*.jsonl") for line in log.read_text().splitlines() if line]
    return [(row[1], int(row[-1])) for row in rows]


def _logged(manifest: Path) -> dict[tuple[str, int, int], str]:
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


def _files(out: Path) -> dict[str, bytes]:
    if out.is_file():
        return {"": out.read_bytes()}
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _same_output(got: Path, want: Path) -> None:
    a, b = _files(got), _files(want)
    assert sorted(a) == sorted(b)
    for name in a:
        if Path(name).name == ".metadata":  # holds a random save_id: compare what it says
            assert repr(read_index(got).entries) == repr(read_index(want).entries)
        else:
            assert a[name] == b[name], f"{name} differs"


@pytest.fixture(scope="module")
def hook(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("resume-hook")
    (folder / "sitecustomize.py").write_text(HOOK)
    return folder


CASES = {
    "pt": (["consolidate", "{ck}", "{out}", "--nproc", "1", *BUDGET], "full.pt"),
    "hf": (["consolidate", "{ck}", "{out}", "--nproc", "1", "--max-shard-size", "40KB", *BUDGET], "hf"),
    "reshard": (["reshard", "{ck}", "{out}", "--world-size", "2", "--nproc", "1"], "ws2"),
}


Reference = tuple[Path, list[tuple[str, int]], int]


@pytest.fixture(scope="module")
def references(ws3_ckpt: Sample, hook: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Reference]:
    """Each case run uninterrupted: its output, its read log, and the most bytes one of its processes moved."""
    root = tmp_path_factory.mktemp("resume-ref")
    refs = {}
    for name, (args, out_name) in CASES.items():
        out = root / name / out_name
        counts = root / f"{name}-moved"
        counts.mkdir()
        out.parent.mkdir()
        argv = [a.format(ck=ws3_ckpt.checkpoint, out=out) for a in args]
        done = _run(argv, logs=root / f"{name}-reads", hook=hook, kill={"RESUME_TEST_COUNT": str(counts)})
        assert done.returncode == 0, done.stderr
        # the most bytes one process moved: the hook's SIGKILL counts per process
        moved = max(int(p.read_text()) for p in counts.iterdir())
        refs[name] = (out, _reads(root / f"{name}-reads"), moved)
    return refs


def _kill(case: str, where: float | str, nproc: int, ws3_ckpt: Sample, ref: Reference, hook: Path, folder: Path) -> list[str]:
    """Start the case's run and SIGKILL it at ``where``; return its arguments (to resume it)."""
    args, out_name = CASES[case]
    out = folder / out_name
    argv = [a.format(ck=ws3_ckpt.checkpoint, out=out) for a in args]
    argv[argv.index("--nproc") + 1] = str(nproc)
    moved = ref[2] // nproc  # the hook counts each process's bytes; the workers share them
    kill = {"RESUME_TEST_KILL_AT": "last"} if where == "last" else {"RESUME_TEST_KILL_AFTER": str(int(moved * float(where)))}
    killed = _run(argv, hook=hook, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    return argv


def _manifest(folder: Path) -> Path:
    (manifest,) = [p for p in folder.iterdir() if ".manifest-" in p.name]
    return manifest


def _resume_and_check(
    case: str, argv: list[str], logged: dict[tuple[str, int, int], str], ref: Reference, folder: Path, *, nothing_missing: bool
) -> tuple[int, int]:
    """Rerun with ``--resume``: the output is identical, nothing is left beside it, and only missing records are read.

    Returns:
        The bytes read again, and the bytes an uninterrupted run reads.
    """
    out, ref_reads, _ = ref
    resumed = _run([*argv, "--resume"], logs=folder / "resume-reads")
    assert resumed.returncode == 0, resumed.stderr
    _same_output(folder / CASES[case][1], out)
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [], "temporary, manifest or lock left"

    reads = _reads(folder / "resume-reads")
    read_fqns = {fqn for fqn, _ in reads}
    ref_bytes: Counter[str] = Counter()
    for fqn, nbytes in ref_reads:
        ref_bytes[fqn] += nbytes
    reread, full = sum(n for _, n in reads), sum(ref_bytes.values())
    if nothing_missing:
        assert reads == [], "every record was written and fsynced: nothing is read again"
    # no more of a tensor is read again than a whole run reads of it, and less than a whole run in all
    assert reread <= sum(ref_bytes[f] for f in read_fqns)
    assert reread < full
    if case != "reshard":  # a consolidation's record is a whole tensor: one kept is never read again
        again_read = read_fqns & set(logged.values())
        assert not again_read, f"read again though kept: {sorted(again_read)[:3]}"
    return reread, full


@pytest.mark.parametrize(
    ("case", "where", "nproc"),
    [
        ("pt", 0.1, 1),
        ("pt", 0.5, 1),
        ("pt", 0.9, 1),
        ("pt", "last", 1),
        ("hf", 0.5, 1),
        ("hf", "last", 1),
        ("reshard", 0.1, 1),
        ("reshard", 0.5, 2),
        ("reshard", "last", 1),
    ],
)
def test_resume_after_sigkill_is_identical_and_reads_only_the_missing(
    case: str, where: float | str, nproc: int, ws3_ckpt: Sample, references: dict[str, Reference], hook: Path, tmp_path: Path
) -> None:
    argv = _kill(case, where, nproc, ws3_ckpt, references[case], hook, tmp_path)
    logged = _logged(_manifest(tmp_path))
    assert logged, "the run was killed before it logged a record"
    if (case, where) == ("pt", 0.5):
        again = _run(argv, logs=tmp_path / "reads")  # without --resume: refused, nothing read or touched
        assert again.returncode == 4 and "--resume" in again.stderr, again.stderr
        assert _reads(tmp_path / "reads") == []

    reread, full = _resume_and_check(case, argv, logged, references[case], tmp_path, nothing_missing=where == "last")
    row = f"{case} --nproc {nproc} at {where} | identical; {len(logged)} records kept | {reread} of {full} bytes read again"
    print(f"\n| SIGKILL | {row} |")


@pytest.mark.parametrize("fault", ["SIGTERM", "dead worker"])
def test_a_sigterm_or_a_dead_worker_keeps_the_temporary_and_resume_finishes_it(
    fault: str, ws3_ckpt: Sample, references: dict[str, Reference], hook: Path, tmp_path: Path
) -> None:
    """A preemption's SIGTERM to the CLI process (``--nproc 1``), or a worker SIGKILLed (``--nproc 2``: the job fails),
    half way through the writes: the error line says the temporary is kept, the temporary and its manifest stay (no lock,
    no output), and ``--resume`` finishes it byte-identical, reading only the missing tensors."""
    args, out_name = CASES["pt"]
    nproc = 1 if fault == "SIGTERM" else 2
    argv = [a.format(ck=ws3_ckpt.checkpoint, out=tmp_path / out_name) for a in args]
    argv[argv.index("--nproc") + 1] = str(nproc)
    half = references["pt"][2] // nproc // 2  # the hook counts each process's bytes; the workers share them
    if fault == "SIGTERM":
        kill = {"RESUME_TEST_TERM_AFTER": str(half)}
    else:
        kill = {"RESUME_TEST_KILL_AFTER": str(half), "RESUME_TEST_KILL_RANK": "1"}
    stopped = _run(argv, hook=hook, kill=kill)
    assert stopped.returncode == (143 if fault == "SIGTERM" else 1), stopped.stderr
    lines = stopped.stderr.strip().splitlines()
    tmp = tmp_path / ".full.tmp-local.pt"
    assert len(lines) == 1, stopped.stderr
    if fault == "SIGTERM":
        assert lines[0].startswith("error: interrupted (SIGTERM); "), lines[0]
    else:  # the launcher may see rank 0's lost connection before rank 1's death
        assert lines[0].startswith(("error: worker rank 1 died", "error: worker rank 0 failed: lost its connection")), lines[0]
    assert f"; the temporary {tmp} (" in lines[0], lines[0]
    assert lines[0].endswith(" written) is kept: run again with --resume to finish it, or remove it"), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".full.manifest-local.pt", tmp.name]
    logged = _logged(_manifest(tmp_path))
    assert logged, "stopped before it logged a record"

    reread, full = _resume_and_check("pt", argv, logged, references["pt"], tmp_path, nothing_missing=False)
    kept = f"exit {stopped.returncode}, kept; {len(logged)} records"
    row = f"pt --nproc {nproc}, half way | {kept} | {reread} of {full} bytes read again"
    print(f"\n| {fault} | {row} |")


def test_resume_rewrites_a_corrupted_record(
    ws3_ckpt: Sample, references: dict[str, Reference], hook: Path, tmp_path: Path
) -> None:
    """A kept record whose bytes no longer match its CRC-32 (flipped inside the temporary) is read again and rewritten."""
    ref, _, _ = references["pt"]
    argv = _kill("pt", 0.5, 1, ws3_ckpt, references["pt"], hook, tmp_path)
    logged = _logged(_manifest(tmp_path))
    (tmp,) = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    (_, offset, nbytes), fqn = max(logged.items(), key=lambda kv: kv[0][2])  # the largest kept tensor
    with open(tmp, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = _run([*argv, "--resume"], logs=tmp_path / "resume-reads")
    assert resumed.returncode == 0, resumed.stderr
    _same_output(tmp_path / "full.pt", ref)
    assert fqn in {f for f, _ in _reads(tmp_path / "resume-reads")}, "the corrupted record was trusted"
    print(f"\n| flipped byte in a kept record | {fqn} in the .pt temporary | CRC mismatch, rewritten; identical |")


def test_resume_refuses_a_different_plan(ws3_ckpt: Sample, references: dict[str, Reference], hook: Path, tmp_path: Path) -> None:
    """Other options than the interrupted run's: one line naming what differs, exit 1, the temporary untouched."""
    argv = _kill("pt", 0.5, 1, ws3_ckpt, references["pt"], hook, tmp_path)
    (tmp,) = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    before = tmp.read_bytes(), sorted(p.read_bytes() for p in _manifest(tmp_path).iterdir())
    done = _run([*argv, "--resume", "--dtype", "bf16"])
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "options" in lines[0] and str(tmp) in lines[0], done.stderr
    assert (tmp.read_bytes(), sorted(p.read_bytes() for p in _manifest(tmp_path).iterdir())) == before
    print("\n| --resume with --dtype bf16 | .pt | exit 1, one line naming the options; nothing touched |")
