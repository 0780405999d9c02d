"""``--resume`` after a SIGKILL on one node: real processes, real signals; the output is identical, only the missing is read.

The hook, the references and the output checks are in ``tests/_resume.py``. The rerun with
``--resume`` must finish with the output byte for byte as an uninterrupted run wrote it and read
(the read log, ``FSDP_CONVERT_READ_LOG``) only chunks of the tensors whose records were missing,
at most what the uninterrupted run read for them. Each case prints a row of the fault table.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests._resume import CASES, Reference, check_rereads, logged_records, manifest_of, read_log, run_cli, same_output
from tests._samples import Sample

pytestmark = pytest.mark.slow


def _kill(
    case: str, where: float | str, nproc: int, ws3_ckpt: Sample, ref: Reference, resume_hook: Path, folder: Path
) -> list[str]:
    """Start the case's run and SIGKILL it at ``where``; return its arguments (to resume it)."""
    args, out_name = CASES[case]
    out = folder / out_name
    argv = [a.format(ck=ws3_ckpt.checkpoint, out=out) for a in args]
    argv[argv.index("--nproc") + 1] = str(nproc)
    moved = ref[2] // nproc  # the hook counts each process's bytes; the workers share them
    kill = {"RESUME_TEST_KILL_AT": "last"} if where == "last" else {"RESUME_TEST_KILL_AFTER": str(int(moved * float(where)))}
    killed = run_cli(argv, hook=resume_hook, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    return argv


def _resume_and_check(
    case: str, argv: list[str], logged: dict[tuple[str, int, int], str], ref: Reference, folder: Path, *, nothing_missing: bool
) -> tuple[int, int]:
    """Rerun with ``--resume``: the output is identical, nothing is left beside it, and only missing records are read.

    Returns:
        The bytes read again, and the bytes an uninterrupted run reads.
    """
    out, ref_reads, _ = ref
    resumed = run_cli([*argv, "--resume"], logs=folder / "resume-reads")
    assert resumed.returncode == 0, resumed.stderr
    same_output(folder / CASES[case][1], out)
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [], "temporary, manifest or lock left"

    return check_rereads(
        read_log(folder / "resume-reads"), ref, logged, whole_records=case != "reshard", nothing_missing=nothing_missing
    )


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
    case: str,
    where: float | str,
    nproc: int,
    ws3_ckpt: Sample,
    resume_references: dict[str, Reference],
    resume_hook: Path,
    tmp_path: Path,
) -> None:
    argv = _kill(case, where, nproc, ws3_ckpt, resume_references[case], resume_hook, tmp_path)
    logged = logged_records(manifest_of(tmp_path))
    assert logged, "the run was killed before it logged a record"
    if (case, where) == ("pt", 0.5):
        again = run_cli(argv, logs=tmp_path / "reads")  # without --resume: refused, nothing read or touched
        assert again.returncode == 4 and "--resume" in again.stderr, again.stderr
        assert read_log(tmp_path / "reads") == []

    reread, full = _resume_and_check(case, argv, logged, resume_references[case], tmp_path, nothing_missing=where == "last")
    row = f"{case} --nproc {nproc} at {where} | identical; {len(logged)} records kept | {reread} of {full} bytes read again"
    print(f"\n| SIGKILL | {row} |")


@pytest.mark.parametrize("fault", ["SIGTERM", "dead worker"])
def test_a_sigterm_or_a_dead_worker_keeps_the_temporary_and_resume_finishes_it(
    fault: str, ws3_ckpt: Sample, resume_references: dict[str, Reference], resume_hook: Path, tmp_path: Path
) -> None:
    """A preemption's SIGTERM to the CLI process (``--nproc 1``), or a worker SIGKILLed (``--nproc 2``: the job fails),
    half way through the writes: the error line says the temporary is kept, the temporary and its manifest stay (no lock,
    no output), and ``--resume`` finishes it byte-identical, reading only the missing tensors."""
    args, out_name = CASES["pt"]
    nproc = 1 if fault == "SIGTERM" else 2
    argv = [a.format(ck=ws3_ckpt.checkpoint, out=tmp_path / out_name) for a in args]
    argv[argv.index("--nproc") + 1] = str(nproc)
    half = resume_references["pt"][2] // nproc // 2  # the hook counts each process's bytes; the workers share them
    if fault == "SIGTERM":
        kill = {"RESUME_TEST_TERM_AFTER": str(half)}
    else:
        kill = {"RESUME_TEST_KILL_AFTER": str(half), "RESUME_TEST_KILL_RANK": "1"}
    stopped = run_cli(argv, hook=resume_hook, kill=kill)
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
    logged = logged_records(manifest_of(tmp_path))
    assert logged, "stopped before it logged a record"

    reread, full = _resume_and_check("pt", argv, logged, resume_references["pt"], tmp_path, nothing_missing=False)
    kept = f"exit {stopped.returncode}, kept; {len(logged)} records"
    row = f"pt --nproc {nproc}, half way | {kept} | {reread} of {full} bytes read again"
    print(f"\n| {fault} | {row} |")


def test_resume_rewrites_a_corrupted_record(
    ws3_ckpt: Sample, resume_references: dict[str, Reference], resume_hook: Path, tmp_path: Path
) -> None:
    """A kept record whose bytes no longer match its CRC-32 (flipped inside the temporary) is read again and rewritten."""
    ref, _, _ = resume_references["pt"]
    argv = _kill("pt", 0.5, 1, ws3_ckpt, resume_references["pt"], resume_hook, tmp_path)
    logged = logged_records(manifest_of(tmp_path))
    (tmp,) = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    (_, offset, nbytes), fqn = max(logged.items(), key=lambda kv: kv[0][2])  # the largest kept tensor
    with open(tmp, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = run_cli([*argv, "--resume"], logs=tmp_path / "resume-reads")
    assert resumed.returncode == 0, resumed.stderr
    same_output(tmp_path / "full.pt", ref)
    assert fqn in {f for f, _ in read_log(tmp_path / "resume-reads")}, "the corrupted record was trusted"
    print(f"\n| flipped byte in a kept record | {fqn} in the .pt temporary | CRC mismatch, rewritten; identical |")


def test_resume_refuses_a_different_plan(
    ws3_ckpt: Sample, resume_references: dict[str, Reference], resume_hook: Path, tmp_path: Path
) -> None:
    """Other options than the interrupted run's: one line naming what differs, exit 1, the temporary untouched."""
    argv = _kill("pt", 0.5, 1, ws3_ckpt, resume_references["pt"], resume_hook, tmp_path)
    (tmp,) = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    before = tmp.read_bytes(), sorted(p.read_bytes() for p in manifest_of(tmp_path).iterdir())
    done = run_cli([*argv, "--resume", "--dtype", "bf16"])
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "options" in lines[0] and str(tmp) in lines[0], done.stderr
    assert (tmp.read_bytes(), sorted(p.read_bytes() for p in manifest_of(tmp_path).iterdir())) == before
    print("\n| --resume with --dtype bf16 | .pt | exit 1, one line naming the options; nothing touched |")
