"""The write side follows no link and never destroys the input (issue 23): each attack on the real sample checkpoint.

Links planted at the names a run writes (the lock, the temporary, the manifest's records log, OUT)
are refused in one line and left as they are, their targets untouched; OUT may not be the input,
inside it or around it; ``--overwrite`` replaces a folder that is not this tool's output only with
``--force``; ``--resume`` beside a live run says who is writing; a SIGKILLed run's staging folder
for an fsspec OUT is removed by the next run. A run is killed mid-write by the resume tests' hook
(``tests/_resume.py``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from subprocess import CompletedProcess

import pytest
from typer.testing import CliRunner

from fsdp_convert.cli import app
from fsdp_convert.writers._lock import acquire_lock
from tests._resume import BUDGET, run_cli, run_env
from tests._samples import Sample

pytestmark = pytest.mark.redteam  # last rounds' attacks: part of `pytest -m redteam`

PRECIOUS = b"precious: not the tool's to write\n"


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links as their targets, files as SHA-256), to compare before and after."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def _one_line(stderr: str, *needles: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(PRECIOUS)
    return path


def test_a_link_at_the_lock_is_refused_and_its_target_kept(
    runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, victim: Path
) -> None:
    """Before: exit 0, and the victim held the lock record ('host pid since -')."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".full.pt.lock").symlink_to(victim)
    result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), str(out / "full.pt"), "--nproc", "1"])
    assert result.exit_code == 1, result.stderr
    _one_line(result.stderr, f"{out / '.full.pt.lock'}: it is a symbolic link")
    assert victim.read_bytes() == PRECIOUS
    assert _tree(out) == {".full.pt.lock": f"-> {victim}"}  # the link left as it was, nothing written


def _killed_run(ckpt: Path, out: Path, hook: Path) -> list[str]:
    """A consolidation SIGKILLed half-way: its temporary, manifest and records log left beside OUT."""
    argv = ["consolidate", str(ckpt), str(out), "--nproc", "1", *BUDGET]
    killed = run_cli(argv, hook=hook, kill={"RESUME_TEST_KILL_AFTER": "60000"})
    assert killed.returncode == -9, killed.stderr
    assert (out.parent / ".full.manifest-local.pt" / "records-0.jsonl").is_file()
    return argv


def test_resume_refuses_links_in_the_left_temporary_and_keeps_it(
    runner: CliRunner, ws3_ckpt: Sample, resume_hook: Path, tmp_path: Path, victim: Path
) -> None:
    """Before: --resume appended its records to a linked records log's target, and wrote the checkpoint into a linked
    temporary's target (then renamed the link into place as OUT). Now both are refused before anything is written."""
    out = tmp_path / "out" / "full.pt"
    out.parent.mkdir()
    argv = _killed_run(ws3_ckpt.checkpoint, out, resume_hook)
    log = out.parent / ".full.manifest-local.pt" / "records-0.jsonl"
    log.rename(log.with_name("records-1.jsonl"))  # the real records are still read from here
    log.symlink_to(victim)
    (out.parent / ".full.pt.lock").unlink()  # the killed run's (a new run takes it over, and removes it)
    before = _tree(out.parent)
    result = runner.invoke(app, [*argv, "--resume"])
    assert result.exit_code == 1, result.stderr
    _one_line(result.stderr, f"{log}: it is a symbolic link")
    assert victim.read_bytes() == PRECIOUS and _tree(out.parent) == before  # the interrupted run's work kept
    log.unlink()
    tmp = out.parent / ".full.tmp-local.pt"
    kept = tmp.with_name("kept.pt")
    tmp.rename(kept)
    tmp.symlink_to(victim)  # the temporary itself a link
    result = runner.invoke(app, [*argv, "--resume"])
    assert result.exit_code == 1, result.stderr
    _one_line(result.stderr, f"{tmp}: it is a symbolic link")
    assert victim.read_bytes() == PRECIOUS and not out.exists()
    tmp.unlink()
    kept.rename(tmp)
    result = runner.invoke(app, [*argv, "--resume"])  # the links gone: the run finishes
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["full.pt"]


def test_a_link_at_the_manifest_folder_is_refused(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Before: exit 1 'cannot write ...: File exists'. Now the line says it is a link; the linked folder is untouched."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_bytes(PRECIOUS)
    (out / ".full.manifest-local.pt").symlink_to(elsewhere)
    result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), str(out / "full.pt"), "--nproc", "1"])
    assert result.exit_code == 1, result.stderr
    _one_line(result.stderr, ".full.manifest-local.pt: it is a symbolic link")
    assert _tree(elsewhere) == {"keep.txt": hashlib.sha256(PRECIOUS).hexdigest()}
    assert _tree(out) == {".full.manifest-local.pt": f"-> {elsewhere}"}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_link_at_out_is_refused(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, victim: Path, overwrite: bool) -> None:
    """Before: with --overwrite, exit 0 and the link replaced (the user's target never written). Now exit 4, before torch."""
    out = tmp_path / "full.pt"
    out.symlink_to(victim)
    argv = ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--nproc", "1"]
    result = runner.invoke(app, argv + ["--overwrite"] * overwrite)
    assert result.exit_code == 4, result.stderr
    _one_line(result.stderr, f"{out} is a symbolic link")
    assert out.is_symlink() and victim.read_bytes() == PRECIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt", "victim.txt"]


@pytest.fixture
def parent(ws3_ckpt: Sample, tmp_path: Path) -> Path:
    """PARENT/ckpt (a copy of the sample) and PARENT/unrelated.txt."""
    folder = tmp_path / "parent"
    shutil.copytree(ws3_ckpt.checkpoint, folder / "ckpt")
    (folder / "unrelated.txt").write_bytes(PRECIOUS)
    return folder


ONTO_THE_INPUT = {
    "consolidate CKPT CKPT": (["consolidate", "{p}/ckpt", "{p}/ckpt"], "{p}/ckpt is the input {p}/ckpt"),
    "consolidate CKPT CKPT/.metadata": (
        ["consolidate", "{p}/ckpt", "{p}/ckpt/.metadata", "--format", "torch"],
        "{p}/ckpt/.metadata is inside the input {p}/ckpt",
    ),
    "consolidate CKPT CKPT/full.pt": (["consolidate", "{p}/ckpt", "{p}/ckpt/full.pt"], "is inside the input {p}/ckpt"),
    "consolidate PARENT/ckpt PARENT": (["consolidate", "{p}/ckpt", "{p}"], "{p} holds the input {p}/ckpt"),
    "reshard CKPT CKPT": (["reshard", "{p}/ckpt", "{p}/ckpt", "--world-size", "1"], "{p}/ckpt is the input {p}/ckpt"),
    "reshard CKPT via a link": (["reshard", "{p}/link", "{p}/ckpt/../ckpt/", "--world-size", "1"], "is the input {p}/link"),
    "consolidate --hf-assets OUT": (
        ["consolidate", "{p}/ckpt", "{p}/hf", "--hf-assets", "{p}/hf/"],
        "{p}/hf is the input {p}/hf",
    ),
}


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("case", sorted(ONTO_THE_INPUT))
def test_out_may_not_be_the_input_inside_it_or_around_it(runner: CliRunner, parent: Path, case: str, overwrite: bool) -> None:
    """Before (with --overwrite): exit 0, and the checkpoint (and PARENT's unrelated file) replaced by the output."""
    (parent / "link").symlink_to(parent / "ckpt")
    (parent / "hf").mkdir()
    (parent / "hf" / "config.json").write_text("{}")
    argv, needle = ONTO_THE_INPUT[case]
    before = _tree(parent)
    result = runner.invoke(app, [a.format(p=parent) for a in argv] + ["--nproc", "1"] + ["--overwrite"] * overwrite)
    assert result.exit_code == 2, result.stderr
    _one_line(result.stderr, needle.format(p=parent), "name another OUT")
    assert _tree(parent) == before


def test_overwrite_replaces_a_folder_not_this_tools_only_with_force(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Before: --overwrite deleted any folder. Now a folder holding a file this tool does not write needs --force."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_bytes(PRECIOUS)
    argv = ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--nproc", "1", "--overwrite"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 4, result.stderr
    _one_line(result.stderr, f"{out} is a folder fsdp-convert did not write (it holds README.md)", "--overwrite --force")
    assert _tree(tmp_path) == {"hf": "dir", "hf/README.md": hashlib.sha256(PRECIOUS).hexdigest()}
    result = runner.invoke(app, [*argv, "--force"])
    assert result.exit_code == 0, result.stderr
    written = sorted(p.name for p in out.iterdir())
    assert "README.md" not in written and "model.safetensors" in written
    result = runner.invoke(app, argv)  # this tool's output now: --overwrite alone replaces it
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == written


def test_resume_beside_a_live_run_names_it_and_suggests_no_removal(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Before: exit 1, 'cannot resume .OUT.tmp-local: no usable manifest ...; remove .OUT.tmp-local and run again'
    (the live run's temporary, whose manifest it had not written yet)."""
    out = tmp_path / "hf"
    lock = acquire_lock(out, None)  # a live run: its lock held, its temporary being written
    try:
        tmp = tmp_path / ".hf.tmp-local"
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"being written")
        before = _tree(tmp_path)
        result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--nproc", "1", "--resume"])
        assert result.exit_code == 4, result.stderr
        line = _one_line(result.stderr, f"{out} is being written by another run, pid {os.getpid()} on ", "wait for it")
        assert "remove" not in line
        assert _tree(tmp_path) == before
    finally:
        lock.release(remove=True)


def _cli(argv: list[str], tmpdir: Path, hook: Path | None = None, kill: dict[str, str] | None = None) -> CompletedProcess[str]:
    env = {**run_env(hook=hook, kill=kill), "TMPDIR": str(tmpdir)}
    cmd = [sys.executable, "-m", "fsdp_convert", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, start_new_session=True)


def test_a_killed_upload_runs_staging_folder_is_removed_by_the_next_run(
    ws3_ckpt: Sample, resume_hook: Path, tmp_path: Path
) -> None:
    """Before: each SIGKILLed run to an fsspec URL left its staging folder (a random name) in TMPDIR for good."""
    staging = tmp_path / "staging"
    staging.mkdir()
    url = "memory://hostile-output/out/full.pt"
    argv = ["consolidate", str(ws3_ckpt.checkpoint), url, "--nproc", "1", *BUDGET]
    killed = _cli(argv, staging, resume_hook, {"RESUME_TEST_KILL_AFTER": "60000"})
    assert killed.returncode == -9, killed.stderr
    left = list(staging.iterdir())
    assert len(left) == 1 and left[0].name.startswith("fsdp-convert-upload-"), left
    # beside it, a live run's of the same URL (this process's pid) and a dead one's of another URL: not this run's
    live = staging / re.sub(r"_\d+_(\w+)$", rf"_{os.getpid()}_\1", left[0].name)
    other = staging / re.sub(r"upload-[0-9a-f]+_", "upload-" + "0" * 16 + "_", left[0].name)  # another URL's digest
    assert len({left[0], live, other}) == 3
    live.mkdir()
    other.mkdir()
    done = _cli(argv, staging)
    assert done.returncode == 0, done.stderr
    said = "".join(done.stderr.split())  # rich wraps the warning at the terminal's width
    assert f"removed{left[0]},thestagingfolderanearlierrunwriting{url}left" in said, done.stderr
    assert sorted(staging.iterdir()) == sorted([live, other])
